#!/usr/bin/env bash
# Install (idempotent, seconds when already installed), then run the test suite.
#   bash scripts/test.sh                 # ruff (format + lint), then everything that can run on this machine
#   bash scripts/test.sh tests/unit -q   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${ORLHF_VENV:-$(pwd)/.venv}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# Tests build their demo model under a private cache so they never race a user's cache.
export ORLHF_CACHE=${ORLHF_CACHE:-$(pwd)/.cache/orlhf-test}
if [ $# -eq 0 ]; then  # the whole suite (CI): formatting and lint first, in a second (ruff.toml)
  "$VENV/bin/ruff" format --check --quiet . || { echo "ruff format: run '$VENV/bin/ruff format .'" >&2; exit 1; }
  "$VENV/bin/ruff" check --quiet .
fi
exec "$VENV/bin/python" -m pytest "${@:-tests}"
