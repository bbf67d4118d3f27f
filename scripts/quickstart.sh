#!/usr/bin/env bash
# Install orlhf, then train the built-in tiny demo with PPO on this machine (CPU is enough).
#   bash scripts/quickstart.sh [extra orlhf train-ppo flags]
set -euo pipefail
cd "$(dirname "$0")/.."
# The install's import check also builds the tiny demo (it has torch and transformers imported already).
ORLHF_INSTALL_DEMO=1 bash scripts/install.sh
VENV=${ORLHF_VENV:-$(pwd)/.venv}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# 40 steps (5 passes over the demo's 512 prompts), half the demo's default: the reward rises >= 1.5x within them
# (tests/e2e's criterion), and the quickstart stays within a few minutes on a small CPU machine.
# Not exec: the run's start-up line counts from its process's start, which exec would date back to this script's
# (the install's minute would then read as "imports").
"$VENV/bin/orlhf" train-ppo --save_path ./runs/quickstart --num_episodes 5 "$@"
