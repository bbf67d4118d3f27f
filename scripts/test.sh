#!/usr/bin/env bash
# Install (idempotent, seconds when already installed), then run the test suite.
#   bash scripts/test.sh                 # everything that can run on this machine
#   bash scripts/test.sh tests/unit -q   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${ORLHF_VENV:-$(pwd)/.venv}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# Tests build their demo model under a private cache so they never race a user's cache.
export ORLHF_CACHE=${ORLHF_CACHE:-$(pwd)/.cache/orlhf-test}
exec "$VENV/bin/python" -m pytest "${@:-tests}"
