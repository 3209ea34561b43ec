"""The quality benchmark scripts in ``bench/`` still run end to end (tiny sizes), and refuse a bad setup
before the model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.bench.script_cases import BENCH, cases, run_script

CASES = cases("quality")


@pytest.mark.slow(seconds=25)  # each a script end to end in a fresh process (20-80 s on two busy cores)
@pytest.mark.parametrize("script, args, expected", CASES)
def test_bench_script_runs(script, args, expected, tmp_path):
    run_script(script, args, expected, tmp_path)


@pytest.mark.parametrize("script", ["bench_real.py", "bench_retrieval.py"])
def test_a_bad_setup_is_refused_before_the_model_loads(script, tmp_path):
    # smollm2-135m is not converted in a clean test cache: an error about it would mean the
    # names were checked too late
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for setups, message in (("DynamicCache,nope", "unknown setup ['nope']"),
                            ("DynamicCache,gone.yaml", "policy file not found: gone.yaml")):
        out = subprocess.run([sys.executable, str(BENCH / script), "--setups", setups, "--out", "out"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
