"""``bench/bench_packed_compile.py`` runs end to end on a short context, and every variant it times
(the C++ kernel, both inductor formulations, the eager reference) computes dequantize-then-SDPA's
attention (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow(seconds=30)  # inductor compiles in a fresh process (~27-34 s on two busy cores)
def test_bench_packed_compile_runs_and_agrees(tmp_path):
    path = os.pathsep.join(p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, str(BENCH / "bench_packed_compile.py"), "--contexts", "128", "--bits", "4", "2",
                          "--reps", "2", "--json", "out.json", "--inductor-cache"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    for text in ("| 128 | 4 |", "| 128 | 2 |", "inductor / cpp", "largest |out - deq-sdpa|", "load average"):
        assert text in out.stdout, out.stdout[-3000:]
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert {r["bits"] for r in rows} == {4, 2}
    for r in rows:
        assert {"inductor", "inductor-fused", "eager", "deq-sdpa", "fp-sdpa"} <= set(r["ms"])
        assert all(d < 1e-5 for d in r["max_diff_vs_deq"].values()), r["max_diff_vs_deq"]
