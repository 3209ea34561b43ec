"""The benchmark scripts' smoke runs, shared by the ``test_scripts*.py`` files: each file runs a
share of them, so the two test workers split the scripts (a test file goes to one worker whole).

    SCRIPTS                 (script, args, expected lines) per run, with readable ids
    GROUPS                  the test file each run belongs to: every run in exactly one (checked here)
    cases(group)            the SCRIPTS params of one group
    run_script(script, args, expected, cwd)
                            runs ``bench/<script> <args>`` in a fresh process with this checkout's
                            package and checks its exit code and that every expected text is printed
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

SCRIPTS = [
    pytest.param("family_sweep.py", ["--families", "llama,deepseek_v32,deepseek_v4,rwkv", "--json", "sweep.json"],
                 ["deepseek_v4                      served", "rwkv                             no cache use",
                  "tiercache gaps (0): none"], id="family-sweep"),
    pytest.param("bench_first_run_rss.py", ["--model", "tiny", "--context", "300", "--new", "4", "--scenarios", "fresh"],
                 ["| fresh | ", "ratio fresh: ", "x | ", "| yes |"], id="first-run-rss"),
    pytest.param("bench_step_overhead.py", ["--layers", "3", "--steps", "5", "--warmup", "1", "--context", "16"],
                 ["| layers | TieredCache ms/step (median) |", "| 3 | "], id="step-overhead"),
    pytest.param("bench_core.py", ["--prompt", "96", "--new", "6", "--repeats", "1"],
                 ["ratio TieredCache / DynamicCache", "identical tokens: True", "| TieredCache (full) |"], id="core"),
    pytest.param("bench_quantize.py", ["--prompt", "160", "--new", "4", "--group", "32", "--residual", "32"],
                 ["tiercache Quantize (native, KIVI)", "QuantizedCache"], id="quantize"),
    pytest.param("bench_offload.py", ["--context", "64", "--new", "4", "--warmup", "1"],
                 ["| offload+int4 |", "bus bytes"], id="offload"),
    pytest.param("bench_memory.py", ["--context", "300", "--new", "2", "--layers", "2", "--hidden", "64", "--heads", "4",
                                     "--kv-heads", "2", "--intermediate", "128", "--vocab", "256",
                                     "--policies", "default,tiered-int4-offload", "--out", "."],
                 ["| default | 300 |", "| tiered-int4-offload |", "runtime baseline", "wrote"], id="memory"),
    pytest.param("bench_regrow.py", ["--dry-run"],
                 ["host MiB/1k", "offload   loop", "offload   prefill", "resident  prefill"], id="regrow"),
    pytest.param("bench_packed_triton.py", ["--dry-run"],  # the Triton interpreter on the CPU: the script runs
                 ["| 64 | attn | ", "| 96 | step | ", "largest |Triton - dequantize-then-SDPA|"], id="packed-triton",
                 marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                          reason="the triton extra")),
    pytest.param("tune_packed_triton.py", ["--dry-run"],  # tiny shapes on the CPU: the sweep's table is printed
                 ["### context 96, int4: shipped setting", "| programs / SM |", "| 4 | 1 | 4 | 1 |"],
                 id="tune-packed-triton",
                 marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                          reason="the triton extra")),
    pytest.param("bench_serve.py", ["--conversations", "1", "--turns", "2", "--history", "200", "--max-tokens", "3",
                                    "--out", "out"],
                 ["| TTFT store (ms) |", "| 2 |", "answers identical in every turn: True", "bench_serve.png"], id="serve"),
    pytest.param("bench_load.py", ["--users", "1,2", "--run-time", "3", "--max-tokens", "4", "--out", "out"],
                 ["| users | requests | failures |", "| 1 | ", "| 2 | ", "load test: locust 3s per level"], id="load",
                 marks=pytest.mark.skipif(importlib.util.find_spec("locust") is None,
                                          reason="the clients extra (locust)")),
    pytest.param("bench_serve.py", ["--scenario", "load", "--repeats", "1", "--context", "32", "--decode", "8",
                                    "--long-prompt", "300", "--history", "200", "--out", "out"],
                 ["median ratio to one alone", "median longest gap / cold prefill", "median TTFT re-prefill / stored",
                  "load average", "bench_serve_load_tiny.json"], id="serve-load"),
    pytest.param("bench_lifecycle.py", ["--layers", "2", "--context", "64", "--kv-heads", "2", "--head-dim", "16",
                                        "--repeats", "1", "--policies", "fp,int4,int4-host,disk"],
                 ["| int4-host | ", "| fp | ", "retier s/GiB", "bench_lifecycle.json"], id="lifecycle"),
    pytest.param("bench_real.py", ["--model", "tiny", "--prompt", "96", "--tokens", "4", "--contexts", "400",
                                   "--depths", "0.5", "--greedy-tokens", "2", "--threads", "1",
                                   "--texts-per-kind", "2",
                                   "--setups", "DynamicCache,int2 +sinks +clip,QuantizedCache quanto int2"],
                 ["| int2 +sinks +clip |", "| QuantizedCache quanto int2 |", "Pass-key retrieval", "% [+0.00%, +0.00%])"],
                 id="real"),
    pytest.param("explore_kv_schemes.py", ["--model", "tiny", "--texts-per-kind", "1", "--prompt", "128", "--tokens",
                                           "16", "--threads", "1", "--schemes",
                                           "int2,K4V2 +sinks,int2 +sinks +Hadamard(V),int2 +sinks pre-RoPE keys"],
                 ["| int2 | ", "| K4V2 +sinks | ", "| int2 +sinks pre-RoPE keys | ", "a proxy, not the cache"],
                 id="explore-schemes"),
    pytest.param("bench_retrieval.py", ["--model", "tiny", "--contexts", "400", "--samples", "2", "--format", "kv",
                                        "--setups", "DynamicCache,int2-sinks", "--out", "out"],
                 ["| DynamicCache | ", "| int2-sinks | ", "Δ vs full precision", "[2/2] "], id="retrieval"),
    pytest.param("bench_retrieval.py", ["--model", "tiny", "--contexts", "400", "--samples", "2", "--needle-attention",
                                        "--out", "out"],
                 ["mean over 2 samples", "| layer | strongest head |", "\n| 3 | ", "table out/needle_attention.md"],
                 id="retrieval-needle-attention"),
]


GROUPS = {
    "core": ["family-sweep", "first-run-rss", "step-overhead", "core", "quantize", "offload", "memory", "regrow", "packed-triton", "tune-packed-triton"],
    "serving": ["serve", "load", "serve-load", "lifecycle"],
    "quality": ["real", "explore-schemes", "retrieval", "retrieval-needle-attention"],
}
_grouped = [i for ids in GROUPS.values() for i in ids]
assert sorted(_grouped) == sorted(p.id for p in SCRIPTS), "every script run belongs to exactly one test file"


def cases(group: str) -> list:
    return [p for p in SCRIPTS if p.id in GROUPS[group]]


def run_script(script: str, args: list[str], expected: list[str], cwd: Path) -> None:
    # this checkout's package, not whichever tiercache the interpreter has installed
    path = os.pathsep.join(p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                         timeout=600, cwd=cwd, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    for text in expected:
        assert text in out.stdout, f"{text!r} missing from the output of {script}:\n{out.stdout[-3000:]}"
