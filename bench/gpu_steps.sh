# Shared by bench/gpu_quick.sh and bench/gpu_suite.sh (sourced, not run): arguments, the summary
# table and `step`, which runs one check under its own `timeout` so that a hang or a failure costs
# only that step. The caller sets NAME (its own name, for messages) and DEFAULT_OUT, then sources
# this file with its arguments; afterwards PYTHON (default python3, the device image's), OUT, DRY,
# DRYFLAG, SUMMARY and FAILED are set, and `finish` prints the summary and exits 0 only when every
# step passed or was skipped.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$DEFAULT_OUT}
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "$NAME: unknown argument $arg (allowed: --dry-run)" >&2; exit 2 ;;
  esac
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
printf '| step | outcome | seconds |\n|---|---|---|\n' > "$SUMMARY"
FAILED=0
DRYFLAG=()
[ "$DRY" = 1 ] && DRYFLAG=(--dry-run)
# a dry run checks that each step runs, on a CPU that may be slow or busy: its limits are looser
SCALE=1; [ "$DRY" = 1 ] && SCALE=${DRY_LIMIT_SCALE:-5}

if [ "$DRY" = 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "$NAME: no CUDA GPU visible to torch ($PYTHON); use --dry-run on a CPU" >&2
  exit 1
fi

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

# skip NAME WHY: a step that cannot run here, said in the summary
skip() {
  echo "== $1: skipped: $2"
  echo "| $1 | skipped: $2 | 0 |" >> "$SUMMARY"
}

# the CUDA tests, by path: every test file that marks a test cuda (no whole-tree collection);
# pytest-timeout, where installed, bounds each test
cuda_tests() {
  local limit=$1 file=$2 tests per_test=()
  mapfile -t tests < <(grep -rlE "pytest\.mark\.cuda|mark\.cuda" tests --include='test_*.py' | sort)
  if [ "$DRY" = 1 ]; then  # on the CPU they skip; collecting them proves their imports need no extra package
    step tests "$limit" "$file" "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda "${tests[@]}"
  else
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=60)
    step tests "$limit" "$file" env TIERCACHE_TEST_CUDA=1 "$PYTHON" -m pytest -q -p no:cacheprovider "${per_test[@]}" \
      -m cuda "${tests[@]}"
  fi
}

finish() {
  echo
  cat "$SUMMARY"
  exit $FAILED
}
