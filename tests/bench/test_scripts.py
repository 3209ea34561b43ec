"""The core benchmark scripts in ``bench/`` still run end to end (tiny sizes: a smoke test, no timing
asserted); the serving and quality scripts: ``test_scripts_serving.py``, ``test_scripts_quality.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.bench.script_cases import BENCH, cases, run_script

CASES = cases("core")


@pytest.mark.slow(seconds=25)  # each a script end to end in a fresh process (20-80 s on two busy cores)
@pytest.mark.parametrize("script, args, expected", CASES)
def test_bench_script_runs(script, args, expected, tmp_path):
    run_script(script, args, expected, tmp_path)


@pytest.mark.slow
def test_gpu_suite_dry_run(tmp_path):
    """bench/gpu_suite.sh --dry-run: the long-context table on a tiny shape (quanto included: this
    venv has it), on the CPU; the summary names each step's outcome, a step with no dry run skipped."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), STEPS="longctx128k memory")
    out = subprocess.run(["bash", str(BENCH / "gpu_suite.sh"), "--dry-run"], capture_output=True, text=True,
                         timeout=1500, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for cache in ("| DynamicCache | 96 |", "| QuantizedCache quanto int4 | 160 |", "| tiered-int4-offload | 160 |",
                  "skipped: offloading=True needs CUDA"):
        assert cache in out.stdout, out.stdout[-3000:]
    assert (tmp_path / "longctx.json").is_file()
    summary = (tmp_path / "summary.md").read_text()
    assert "| longctx128k | ok |" in summary and "| memory | skipped" in summary, summary


def test_the_per_layer_searches_point_to_tune():
    done = subprocess.run([sys.executable, str(BENCH / "bench_real.py"), "--model", "tiny", "--upgrade-search"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tiercache tune" in done.stderr
