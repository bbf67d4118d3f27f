#!/usr/bin/env bash
# What one GPU can prove about orlhf, on a CUDA machine that has torch and transformers but no Ray, vLLM or
# flash-attn, and no package index: runs tests/gpu (the workers are plain classes; no Ray, no vLLM needed).
#
#   bash scripts/gpu_check.sh --build-wheels DIR   # on a machine with a package index: DeepSpeed built with
#                                                  # DS_BUILD_OPS=0 (a few MB, ops JIT-compile on the GPU
#                                                  # box) plus its small pure/binary deps and pytest, and Ray
#                                                  # without its Java jar and dashboard web client, into DIR
#   bash scripts/gpu_check.sh DIR                  # on the GPU machine: install from DIR only, run tests/gpu
#
# --build-wheels: every wheel is for Python 3.12 (cp312, or pure Python), the GPU image's only Python: a wheel for
# another Python would be carried and never installed. DeepSpeed's dependencies, TRL's, Ray and the dependencies of
# Ray's the GPU image lacks (jsonschema, jsonschema-specifications, referencing, rpds-py, and attrs, which the first
# and third need). Ray's cp312 manylinux wheel goes through
# scripts/strip_wheel.py (ray/jars/* and ray/dashboard/client/build/* dropped, RECORD rewritten). It ends by
# printing DIR's size and fails (exit 1, naming the largest files) if DIR plus the repository's tracked files
# exceed 64 MiB, what one call to the GPU machine can be handed.
#
# The second form makes .gpu-check/venv (it sees the host's torch and transformers through a .pth file, so
# nothing of the host's environment changes), installs DeepSpeed and whatever of its dependencies the host
# lacks from DIR (--no-index), then runs pytest on tests/gpu with DS_ACCELERATOR=cuda and prints the GPU, the
# test summary and the measured figures (JSON lines). FusedAdam compiles on first use: it needs nvcc + ninja.
# When DIR holds the Ray wheel and the host is Python 3.12, Ray goes into that venv too (its other dependencies
# from the host), so tests/gpu can import it; this script never starts Ray.
# Then benchmarks/bench_train_mfu.py measures the actor's train step (tokens/s, MFU, peak memory against the plan),
# and benchmarks/trl_compare.py --device cuda runs a short orlhf (--vllm_num_engines 0) against TRL's GRPOTrainer
# (trl, datasets, dill and multiprocess come from DIR too; the rest of their dependencies from the host: without
# them the comparison is left out, saying why).
# PYTHON picks the host interpreter (default python3). Exit status: pytest's, else the benchmarks'.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
log() { echo "[gpu_check] $*" >&2; }
DEEPSPEED=$("$PY" -c "import runpy; print(runpy.run_path('orlhf/versions.py')['DEEPSPEED'])")
RAY=$("$PY" -c "import runpy; print(runpy.run_path('orlhf/versions.py')['RAY'])")
# DeepSpeed's requirements (0.19.8) besides torch, numpy, packaging and tqdm (transformers brings those three),
# and pytest. numpy's wheels alone would not fit what a GPU box can be handed (64 MiB).
DEPS="einops hjson msgpack ninja psutil py-cpuinfo pydantic pytest pytest-timeout"
# benchmarks/trl_compare.py's TRL side: what TRL needs that the GPU image lacks, at the versions TRL's CPU virtualenv
# runs with (the image has accelerate, pyarrow, pandas, xxhash, fsspec and huggingface-hub).
TRL=$(sed -n 's/^TRL_VERSION = "\(.*\)"$/\1/p' benchmarks/trl_compare.py)
TRL_DEPS="trl==$TRL datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"
# The GPU image's Python: what --build-wheels fetches every wheel for.
GPU_PYTHON=3.12
WHEEL_FOR=(--only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if [ "${1:-}" = --build-wheels ]; then
  DIR=${2:?usage: gpu_check.sh --build-wheels DIR}
  mkdir -p "$DIR"
  log "DeepSpeed $DEEPSPEED wheel with no prebuilt ops -> $DIR"
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$DIR" "deepspeed==$DEEPSPEED"
  # Binary deps (pydantic-core, msgpack, ninja, psutil) as cp312 wheels.
  log "dependencies for Python $GPU_PYTHON (manylinux x86_64)"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q "${WHEEL_FOR[@]}" -d "$DIR" $DEPS
  log "TRL $TRL and what it needs beyond the GPU image, for Python $GPU_PYTHON"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps "${WHEEL_FOR[@]}" -d "$DIR" $TRL_DEPS
  # Ray for the GPU image's Python only: 79 MB as published, ~45 MB without the Java workers' jar (32 MB) and the
  # dashboard's built web client, neither of which a Python worker loads.
  RAY_TMP=$(mktemp -d)
  trap 'rm -rf "$RAY_TMP"' EXIT
  log "Ray $RAY for Python $GPU_PYTHON (manylinux x86_64), stripped of ray/jars and the dashboard client -> $DIR"
  "$PY" -m pip download -q --no-deps "${WHEEL_FOR[@]}" -d "$RAY_TMP" "ray==$RAY"
  "$PY" scripts/strip_wheel.py "$RAY_TMP"/ray-"$RAY"-*.whl "$DIR" \
    --drop 'ray/jars/*' --drop 'ray/dashboard/client/build/*' >&2
  # What Ray needs that the GPU image lacks (click, filelock, msgpack, protobuf, pyyaml, requests, aiosignal and
  # frozenlist are there); rpds-py is binary.
  log "Ray's missing dependencies for Python $GPU_PYTHON -> $DIR"
  "$PY" -m pip download -q --no-deps "${WHEEL_FOR[@]}" -d "$DIR" jsonschema jsonschema-specifications referencing \
    rpds-py attrs
  # What one call to the GPU machine is handed: this folder and the repository's tracked files, 64 MiB at most.
  "$PY" - "$DIR" <<'PY'
import os, subprocess, sys
from pathlib import Path
LIMIT = 64 * 2**20
wheels = {p: p.stat().st_size for p in Path(sys.argv[1]).rglob("*") if p.is_file()}
tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, text=True, check=True).stdout.split("\0")
repo = {Path(f): os.path.getsize(f) for f in tracked if f and os.path.isfile(f)}
mib = lambda n: f"{n / 2**20:.1f} MiB"
total = sum(wheels.values()) + sum(repo.values())
print(f"[gpu_check] {sys.argv[1]}: {mib(sum(wheels.values()))} in {len(wheels)} files; with the repository's "
      f"tracked files ({mib(sum(repo.values()))}): {mib(total)} of the {mib(LIMIT)} a GPU call can be handed",
      file=sys.stderr)
if total > LIMIT:
    largest = sorted({**wheels, **repo}.items(), key=lambda kv: -kv[1])[:8]
    print("[gpu_check] too large; the largest files:\n" + "\n".join(f"  {mib(n):>10}  {p}" for p, n in largest),
          file=sys.stderr)
    sys.exit(1)
PY
  exit 0
fi

DIR=${1:?usage: gpu_check.sh WHEEL_DIR   (make it with: gpu_check.sh --build-wheels WHEEL_DIR)}
DIR=$(cd "$DIR" && pwd)
ls "$DIR"/deepspeed-"$DEEPSPEED"-*.whl >/dev/null 2>&1 || { log "no deepspeed-$DEEPSPEED wheel in $DIR"; exit 2; }
"$PY" - <<'PY' || [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ] || { log "this check needs a CUDA GPU visible to torch"; exit 2; }
import sys, torch, transformers
ok = torch.cuda.is_available()
print(f"[gpu_check] torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"GPUs: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else 'none'}",
      file=sys.stderr)
sys.exit(0 if ok else 1)
PY
# GPU_CHECK_ALLOW_CPU=1 runs on without a GPU (every GPU test then skips): to check this script itself.
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >&2 || true

VENV=$ROOT/.gpu-check/venv
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV (host packages visible through a .pth file)"
  # No pip of its own: the venv's bundled setuptools would shadow the host's (torch 2.13 requires >= 77).
  "$PY" -m venv --system-site-packages --without-pip "$VENV"
  # The host interpreter may itself be a venv, whose packages --system-site-packages would not show.
  # addsitedir (not a plain path line) so the host's own .pth files (editable installs, ...) apply too.
  VSITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  "$PY" -c "import site; print('import site; ' + '; '.join(f'site.addsitedir({d!r})' for d in
            site.getsitepackages() + [site.getusersitepackages()]))" >"$VSITE/_orlhf_host_sites.pth"
fi
HOST_PYTHON=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")
[ "$HOST_PYTHON" = "$GPU_PYTHON" ] ||
  log "$DIR holds wheels for Python $GPU_PYTHON (the GPU image's); this host is $HOST_PYTHON: what it lacks may not install"
log "installing deepspeed $DEEPSPEED (and what the host lacks of: $DEPS) from $DIR, no index"
"$PY" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check --no-index --find-links "$DIR" \
  "deepspeed==$DEEPSPEED" pytest pytest-timeout
RAY_WHEELS=("$DIR"/ray-"$RAY"-*.whl)
if [ -e "${RAY_WHEELS[0]}" ]; then
  TAG=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
  if [[ "${RAY_WHEELS[*]}" == *-"$TAG"-* ]]; then
    log "installing ray $RAY (stripped wheel) and what the host lacks of its dependencies from $DIR, no index"
    # Not fatal: the tests that need Ray skip without it.
    "$PY" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check --no-index --find-links "$DIR" \
      "ray==$RAY" || log "Ray did not install (pip says why above): the tests that need it will skip"
  else
    log "not installing Ray: $DIR has it for another Python (${RAY_WHEELS[*]##*/}), the host is $TAG"
  fi
fi

if ls "$DIR"/trl-"$TRL"-*.whl >/dev/null 2>&1; then
  log "installing $TRL_DEPS from $DIR, no index (their other dependencies from the host)"
  # shellcheck disable=SC2086
  "$PY" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check --no-index --find-links "$DIR" \
    $TRL_DEPS || log "TRL did not install (pip says why above): the TRL comparison will be left out"
fi

REPORT=$ROOT/.gpu-check/report.jsonl
: >"$REPORT"
set +e
DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ORLHF_GPU_REPORT=$REPORT PYTHONPATH=$ROOT \
  "$VENV/bin/python" -m pytest tests/gpu -v -rA -p no:cacheprovider "${@:2}"
rc=$?
# The actor's train step on random 0.4B and 1B Llamas: tokens/s, MFU, peak memory against `orlhf plan`, top kernels
# (benchmarks/bench_train_mfu.py; a tiny model on CPU under GPU_CHECK_ALLOW_CPU=1 without a GPU).
# GPU_CHECK_MFU_ARGS replaces its arguments; "skip" leaves it out.
MFU_ARGS="--sizes 0.4b,1b --micro_batch 8 --seq_len 1024 --warmup 1 --steps 3"
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
  MFU_ARGS="--device cpu --sizes tiny --micro_batch 2 --seq_len 32 --warmup 0 --steps 1"
MFU_ARGS=${GPU_CHECK_MFU_ARGS:-$MFU_ARGS}
if [ "$MFU_ARGS" != skip ]; then
  log "bench_train_mfu.py $MFU_ARGS"
  # shellcheck disable=SC2086
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ORLHF_GPU_REPORT=$REPORT PYTHONPATH=$ROOT \
    "$VENV/bin/python" benchmarks/bench_train_mfu.py $MFU_ARGS --out "$ROOT/.gpu-check/train_mfu.json"
  mfu_rc=$?
  [ $rc -ne 0 ] || rc=$mfu_rc
  log "bench_train_mfu exit status $mfu_rc (its JSON: .gpu-check/train_mfu.json)"
fi
# orlhf train-ppo --vllm_num_engines 0 against TRL's GRPOTrainer on the same 0.4B model, prompts, reward and batch,
# bf16, 4 steps each (1 not measured); --profile adds a profiled run of each with per-phase GPU seconds.
# GPU_CHECK_TRL_ARGS replaces the arguments; "skip" leaves it out. Without a GPU: the demo model on CPU.
TRL_ARGS="--device cuda --repeats 1 --max_samples 256 --episodes 1 --warmup 1 --timeout 420"
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
  TRL_ARGS="--device cpu --modes orlhf_trainer,trl --trl_python $VENV/bin/python --max_samples 192 --episodes 1"
TRL_ARGS=${GPU_CHECK_TRL_ARGS:-$TRL_ARGS}
if [ "$TRL_ARGS" != skip ] && ! "$VENV/bin/python" -c "import trl" 2>/dev/null; then
  log "TRL comparison left out: trl does not import in $VENV (make DIR with this script's --build-wheels)"
elif [ "$TRL_ARGS" != skip ]; then
  log "trl_compare.py $TRL_ARGS"
  # shellcheck disable=SC2086
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ORLHF_GPU_REPORT=$REPORT PYTHONPATH=$ROOT \
    "$VENV/bin/python" benchmarks/trl_compare.py $TRL_ARGS --out "$ROOT/.gpu-check/trl_compare" \
    >"$ROOT/.gpu-check/trl_compare.log" 2>&1
  trl_rc=$?
  tail -n 12 "$ROOT/.gpu-check/trl_compare.log" | cut -c1-400 >&2
  [ $rc -ne 0 ] || rc=$trl_rc
  log "trl_compare exit status $trl_rc (its output: .gpu-check/trl_compare.log)"
fi
set -e
log "measured figures ($REPORT):"
cat "$REPORT" >&2
log "exit status $rc (pytest's, else the benchmarks')"
exit $rc
