"""The benchmark scripts in ``bench/`` still run end to end (tiny sizes: a smoke test, no timing asserted)."""

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


@pytest.mark.slow(seconds=25)  # each a script end to end in a fresh process (20-80 s on two busy cores)
@pytest.mark.parametrize("script, args, expected", SCRIPTS)
def test_bench_script_runs(script, args, expected, tmp_path):
    # this checkout's package, not whichever tiercache the interpreter has installed
    path = os.pathsep.join(p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    for text in expected:
        assert text in out.stdout, f"{text!r} missing from the output of {script}:\n{out.stdout[-3000:]}"


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


@pytest.mark.slow
def test_gpu_suite_dry_run(tmp_path):
    """bench/gpu_suite.sh --dry-run: the long-context table on a tiny shape (quanto included: this
    venv has it), on the CPU; the summary names each step's outcome, a step with no dry run skipped."""
    import os

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


