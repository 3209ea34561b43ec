#!/usr/bin/env bash
# The long GPU run, after bench/gpu_quick.sh has passed: the CUDA tests, the long-context table at
# 128k (bench/bench_longctx.py: 8B-shaped random bf16 model, chunked prefill, transformers' caches
# and ours: prefill s, decode tok/s, peak device memory, 24 GB cap), planned vs measured memory and
# the offload benchmark, the Triton kernel from 1k to 32k, a sweep of its launch settings
# (bench/tune_packed_triton.py, STEPS="tune" only: not in the default list). Each step under its own `timeout` and
# with its own output file, so one hang or failure costs only that step; the steps' limits add up
# to more than one 10-minute device call: STEPS picks some (e.g. STEPS="longctx128k" for one call,
# then STEPS="memory offload triton"). Results in $OUT (default out/gpu).
#
#   bench/gpu_suite.sh             # needs a CUDA GPU
#   bench/gpu_suite.sh --dry-run   # tiny shapes on the CPU: checks that the suite runs (tests use it)
#
# PYTHON picks the interpreter (default python3, the device image's).
NAME=gpu_suite.sh DEFAULT_OUT=out/gpu
source "$(dirname "$0")/gpu_steps.sh"
STEPS=${STEPS:-tests longctx128k memory offload triton}

for s in $STEPS; do
  case $s in
    tests) cuda_tests 120 cuda-tests.txt ;;
    longctx128k)
      if [ "$DRY" = 1 ]; then
        step longctx128k 120 longctx.md "$PYTHON" bench/bench_longctx.py --dry-run --out "$OUT"
      else
        step longctx128k 560 longctx.md "$PYTHON" bench/bench_longctx.py --device cuda --contexts 131072 --out "$OUT"
      fi ;;
    memory)
      if [ "$DRY" = 1 ]; then
        skip memory "bench_memory.py --device cuda has no CPU dry run"
      else
        step memory 240 memory.md "$PYTHON" bench/bench_memory.py --device cuda --context 32768 --out "$OUT"
      fi ;;
    offload)
      if [ "$DRY" = 1 ]; then
        step offload 120 offload.md "$PYTHON" bench/bench_offload.py --context 256 --new 8
      else
        step offload 240 offload.md "$PYTHON" bench/bench_offload.py --device cuda --layers 32 --kv-heads 8 \
          --head-dim 128 --hidden 1024 --context 32768
      fi ;;
    triton)
      if "$PYTHON" -c "import triton" 2>/dev/null; then
        step triton 240 packed-triton.md "$PYTHON" bench/bench_packed_triton.py --json "$OUT/packed-triton.json" "${DRYFLAG[@]}"
      else
        skip triton "triton is not installed"
      fi ;;
    tune)
      if "$PYTHON" -c "import triton" 2>/dev/null; then
        step tune 240 tune-triton.md "$PYTHON" bench/tune_packed_triton.py --bits 4,2 "${DRYFLAG[@]}"
      else
        skip tune "triton is not installed"
      fi ;;
    *) echo "gpu_suite.sh: unknown step $s (allowed: tests longctx128k memory offload triton tune)" >&2; exit 2 ;;
  esac
done
finish
