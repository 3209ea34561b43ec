#!/usr/bin/env bash
# The first thing to run when a GPU is lent: ends within 9 minutes on an H100, each step under its
# own `timeout` (one hang costs only its own step), at most 8 files in $OUT. It needs only what the
# device image has (python3 with torch, transformers, triton, pytest): a step that needs a missing
# package skips it and says so. In order:
#   env       versions and device (peak memory bandwidth)
#   tests     the CUDA tests, named by path (the files that use @pytest.mark.cuda; nothing else is collected)
#   triton    the Triton packed kernel vs dequantize-then-SDPA and DynamicCache: correctness, ms, GB/s
#   profile   20 int4 decode steps of one 8B-shaped layer at 32k: kernel launches and CPU ms per step
#   persist   save, load(device="cuda"), update
#   offload   offloaded decode at batch 2 across 256-token boundaries: step times, host waits, reserved memory
#   longctx   one row per cache at 32k on the 8B shape (warmed up first; compile outside the timing)
#
#   bench/gpu_quick.sh             # on a CUDA machine; results in $OUT (default out/gpu-quick)
#   bench/gpu_quick.sh --dry-run   # tiny shapes on the CPU: every step runs (tests/bench/test_gpu_quick.py)
#
# PYTHON picks the interpreter (default python3, the device image's). Exit status: 0 when every
# step passed or skipped, 1 when one failed or timed out (summary.md lists each step's outcome).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-out/gpu-quick}
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "gpu_quick.sh: unknown argument $arg (allowed: --dry-run)" >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
echo "| step | outcome | seconds |" > "$SUMMARY"
echo "|---|---|---|" >> "$SUMMARY"
FAILED=0
DRYFLAG=()
[ "$DRY" = 1 ] && DRYFLAG=(--dry-run)

# a dry run checks that each step runs, on a CPU that may be slow or busy: its limits are looser
SCALE=1; [ "$DRY" = 1 ] && SCALE=${DRY_LIMIT_SCALE:-5}

# step NAME LIMIT_S FILE CMD...: runs CMD under `timeout`, tees its output into $OUT/FILE
step() {
  local name=$1 limit=$(($2 * SCALE)) file=$3; shift 3
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$file"
  local rc=${PIPESTATUS[0]} outcome
  case $rc in
    0) outcome=ok ;;
    124|137) outcome="TIMED OUT after ${limit}s"; FAILED=1 ;;
    *) outcome="FAILED (exit $rc)"; FAILED=1 ;;
  esac
  echo "| $name | $outcome | $((SECONDS - t0)) |" >> "$SUMMARY"
  echo "-- $name: $outcome"
}

skip() {
  echo "== $1: skipped: $2"
  echo "| $1 | skipped: $2 | 0 |" >> "$SUMMARY"
}

if [ "$DRY" = 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_quick.sh: no CUDA GPU visible to torch ($PYTHON); use --dry-run on a CPU" >&2
  exit 1
fi

step env 60 env.md "$PYTHON" bench/gpu_quick.py env "${DRYFLAG[@]}"
if [ "$DRY" = 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.mem --format=csv >> "$OUT/env.md" 2>&1 || true; fi

# the CUDA tests, by path: every test file that marks a test cuda (no whole-tree collection)
mapfile -t CUDA_TESTS < <(grep -rlE "pytest\.mark\.cuda|mark\.cuda" tests --include='test_*.py' | sort)
if [ "$DRY" = 1 ]; then  # on the CPU they skip; collecting them proves their imports need no extra package
  step tests 120 cuda-tests.txt "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda "${CUDA_TESTS[@]}"
else  # pytest-timeout, where installed, bounds each test so that one hang does not cost the others
  PER_TEST=(); "$PYTHON" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=60)
  step tests 110 cuda-tests.txt env TIERCACHE_TEST_CUDA=1 "$PYTHON" -m pytest -q -p no:cacheprovider "${PER_TEST[@]}" -m cuda "${CUDA_TESTS[@]}"
fi

if "$PYTHON" -c "import triton" 2>/dev/null; then
  step triton 90 triton.md "$PYTHON" bench/bench_packed_triton.py --contexts 4096,32768 --iters 50 --repeats 3 "${DRYFLAG[@]}"
else
  skip triton "triton is not installed"
fi
step profile 60 profile.md "$PYTHON" bench/gpu_quick.py profile "${DRYFLAG[@]}"
step persist 45 persist.md "$PYTHON" bench/gpu_quick.py persist "${DRYFLAG[@]}"
step offload 60 offload.md "$PYTHON" bench/gpu_quick.py offload "${DRYFLAG[@]}"
if [ "$DRY" = 1 ]; then
  step longctx 120 longctx.md "$PYTHON" bench/bench_longctx.py --dry-run --out "$OUT/longctx"
else
  step longctx 150 longctx.md "$PYTHON" bench/bench_longctx.py --device cuda --contexts 32768 --new 16 --out "$OUT/longctx"
fi
rm -rf "$OUT/longctx"  # its JSON repeats longctx.md's table; $OUT brings back at most 8 files
echo
cat "$SUMMARY"
exit $FAILED
