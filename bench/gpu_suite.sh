#!/usr/bin/env bash
# The GPU suite: on a CUDA machine, run the CUDA tests, then the long-context table
# (bench/bench_longctx.py: 8B-shaped random bf16 model at 32k and 128k tokens, chunked prefill,
# transformers' caches and ours, prefill s, decode tok/s, peak device memory, 24 GB cap) and the
# offload benchmark on the GPU. Results go to $OUT (default out/gpu).
#
#   bench/gpu_suite.sh             # needs a CUDA GPU
#   bench/gpu_suite.sh --dry-run   # a tiny shape on the CPU: checks that the suite runs (tests use it)
#
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
OUT=${OUT:-out/gpu}
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "gpu_suite.sh: unknown argument $arg (allowed: --dry-run)" >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = 1 ]; then
  echo "== dry run (CPU, tiny shape); on a GPU this step runs: TIERCACHE_TEST_CUDA=1 $PYTHON -m pytest -q -m cuda tests"
  "$PYTHON" bench/bench_longctx.py --dry-run --out "$OUT"
  exit 0
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_suite.sh: no CUDA GPU visible to torch; use --dry-run on a CPU" >&2
  exit 1
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
echo "== CUDA tests"
TIERCACHE_TEST_CUDA=1 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests | tee "$OUT/cuda-tests.txt"
echo "== long-context table (32k, 128k)"
"$PYTHON" bench/bench_longctx.py --device cuda --contexts 32768,131072 --out "$OUT" | tee "$OUT/longctx.md"
echo "== planned vs max_memory_allocated (bench_memory.py --device cuda, 32k)"
"$PYTHON" bench/bench_memory.py --device cuda --context 32768 --out "$OUT" | tee "$OUT/memory.md"
echo "== offload benchmark on the GPU"
"$PYTHON" bench/bench_offload.py --device cuda --layers 32 --kv-heads 8 --head-dim 128 --hidden 1024 \
  --context 32768 | tee "$OUT/offload.md"
echo "== packed attention: the Triton kernel vs dequantize-then-SDPA and DynamicCache (1k-32k)"
"$PYTHON" bench/bench_packed_triton.py --json "$OUT/packed-triton.json" | tee "$OUT/packed-triton.md"
