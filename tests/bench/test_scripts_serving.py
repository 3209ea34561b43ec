"""The serving and lifecycle benchmark scripts in ``bench/`` still run end to end (tiny sizes)."""

from __future__ import annotations

import pytest

from tests.bench.script_cases import cases, run_script

CASES = cases("serving")


@pytest.mark.slow(seconds=25)  # each a script end to end in a fresh process (20-80 s on two busy cores)
@pytest.mark.parametrize("script, args, expected", CASES)
def test_bench_script_runs(script, args, expected, tmp_path):
    run_script(script, args, expected, tmp_path)
