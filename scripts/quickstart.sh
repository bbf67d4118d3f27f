#!/usr/bin/env bash
# Install orlhf, then train the built-in tiny demo with PPO on this machine (CPU is enough).
#   bash scripts/quickstart.sh [extra orlhf train-ppo flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${ORLHF_VENV:-$(pwd)/.venv}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/orlhf" train-ppo --save_path ./runs/quickstart "$@"
