#!/usr/bin/env bash
# The first thing to run when a GPU is lent: ends within 9 minutes on an H100 (the steps' limits add
# up to 525 s; a first H100 run took 4.5 minutes), each step under its own `timeout` (one hang costs only its own step), at most 8 files in $OUT. It needs only what the
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
#   STEPS="tests persist" bench/gpu_quick.sh   # a rerun of some steps (default: all, in the order above)
#   bench/gpu_quick.sh --dry-run   # tiny shapes on the CPU: every step runs (tests/bench/test_gpu_quick.py)
#
# PYTHON picks the interpreter (default python3, the device image's). Exit status: 0 when every
# step passed or skipped, 1 when one failed or timed out (summary.md lists each step's outcome).
NAME=gpu_quick.sh DEFAULT_OUT=out/gpu-quick
source "$(dirname "$0")/gpu_steps.sh"
STEPS=${STEPS:-env tests triton profile persist offload longctx}  # a rerun may pick some
want() { [[ " $STEPS " == *" $1 "* ]]; }

want env && step env 30 env.md "$PYTHON" bench/gpu_quick.py env "${DRYFLAG[@]}"
if want env && [ "$DRY" = 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.mem --format=csv >> "$OUT/env.md" 2>&1 || true; fi

want tests && cuda_tests 100 cuda-tests.txt

if ! want triton; then :
elif "$PYTHON" -c "import triton" 2>/dev/null; then
  step triton 75 triton.md "$PYTHON" bench/bench_packed_triton.py --contexts 4096,32768 --iters 50 --repeats 3 "${DRYFLAG[@]}"
else
  skip triton "triton is not installed"
fi
want profile && step profile 90 profile.md "$PYTHON" bench/gpu_quick.py profile "${DRYFLAG[@]}"
want persist && step persist 40 persist.md "$PYTHON" bench/gpu_quick.py persist "${DRYFLAG[@]}"
want offload && step offload 60 offload.md "$PYTHON" bench/gpu_quick.py offload "${DRYFLAG[@]}"
if ! want longctx; then :
elif [ "$DRY" = 1 ]; then
  step longctx 120 longctx.md "$PYTHON" bench/bench_longctx.py --dry-run --out "$OUT/longctx"
else
  step longctx 130 longctx.md "$PYTHON" bench/bench_longctx.py --device cuda --contexts 32768 --new 16 --out "$OUT/longctx"
fi
rm -rf "$OUT/longctx"  # its JSON repeats longctx.md's table; $OUT brings back at most 8 files
finish
