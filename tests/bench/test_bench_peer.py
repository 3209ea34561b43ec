"""bench/bench_peer.py (tiercache serve against transformers serve) and bench/profile_step.py run:
their argument checks, the peer's skip paths, the quick comparison and the step profile (no
timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, args: list, cwd: Path, timeout: float = 120):
    path = os.pathsep.join(p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONPATH": path})


def smollm2_converted() -> bool:
    from tiercache.models import real

    return real._complete(real.cache_dir())


@pytest.mark.parametrize("args, message", [
    (["--users", "0,8"], "--users must be comma-separated whole numbers >= 1, got '0,8'"),
    (["--users", "a"], "--users must be comma-separated whole numbers >= 1"),
    (["--histories", "9000"], "--histories: at most 7000 tokens"),
    (["--histories", "100"], "--histories: each must be at least --turns x (--turn-tokens + 32)"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--threads", "-1"], "--threads must be >= 0"),
])
def test_bad_arguments_are_refused(args, message, tmp_path):
    out = run("bench_peer.py", args, tmp_path)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_skips_without_a_transformers_cli(tmp_path):
    out = run("bench_peer.py", ["--quick", "--transformers", str(tmp_path / "no-such-cli")], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SKIP: transformers serve cannot start" in out.stdout and "is not an executable file" in out.stdout
    assert "tiercache serve:" not in out.stdout  # nothing to compare with: tiercache is not run


def test_skips_when_transformers_serve_exits(tmp_path):
    cli = tmp_path / "transformers"
    cli.write_text("#!/bin/sh\necho 'no serving extra here' >&2\nexit 3\n")
    cli.chmod(0o755)
    out = run("bench_peer.py", ["--quick", "--transformers", str(cli), "--peer-timeout", "60"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SKIP: transformers serve cannot start" in out.stdout, out.stdout
    if smollm2_converted():  # else the skip names the model that cannot be prepared
        assert "exited with code 3" in out.stdout and "no serving extra here" in out.stdout, out.stdout


@pytest.mark.slow(seconds=150)
@pytest.mark.skipif(not Path(sys.executable).with_name("transformers").is_file(), reason="no transformers CLI")
def test_quick_comparison_runs(tmp_path):
    if not smollm2_converted():
        pytest.skip("smollm2-135m is not converted here (the real extra)")
    out = run("bench_peer.py", ["--quick", "--json", "peer.json"], tmp_path, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SKIP" not in out.stdout, out.stdout[-3000:]
    for text in ("transformers serve --continuous-batching:", "tiercache serve:", "| 2 user(s), aggregate tok/s |",
                 "| next turn after 300 tokens of history, TTFT ms |", "re-prefill / stored",
                 "same turn as a new conversation (cold prefill), TTFT ms", "wrote peer.json"):
        assert text in out.stdout, f"{text!r} missing:\n{out.stdout[-3000:]}"
    result = json.loads((tmp_path / "peer.json").read_text())
    ours = result["tiercache"]["history"]["300"]["runs"][0]
    assert ours["cached"] > 0 and ours["prompt"] > 200  # the next turn reused the stored conversation
    assert ours["ttft_cold"] > 0 and result["peer"]["history"]["300"]["runs"][0]["ttft_cold"] > 0
    assert all(r["ratio"] > 0 for r in result["ratios"])


@pytest.mark.slow
def test_profile_step_breaks_a_step_down(tmp_path):
    out = run("profile_step.py", ["--model", "tiny", "--users", "2,3", "--steps", "3", "--context", "24", "--top", "4",
                                  "--live-tokens", "10", "--json", "p.json"], tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for text in ("### 2 users: a decode step", "### 3 users", "| matmuls (nn.Linear) |", "| cache updates (TieredCache",
                 "| event loop + HTTP (live server", "| operator | self ms per step |", "| function | own ms per step |"):
        assert text in out.stdout, f"{text!r} missing:\n{out.stdout[-3000:]}"
    result = json.loads((tmp_path / "p.json").read_text())
    for r in result["runs"]:
        parts = r["parts_ms"]
        assert all(v >= 0 for v in parts.values()) and parts["matmuls (nn.Linear)"] > 0
        assert parts["cache updates (TieredCache.update, StepWorkspace.write)"] > 0 and parts["sampling (Sampler)"] > 0
        # the parts are exclusive times inside the step: together they are the step (timers on)
        assert 0.5 * r["step_ms_with_timers"] < sum(parts.values()) < 1.5 * r["step_ms_with_timers"], r
        assert r["live"]["period_ms"] > 0


@pytest.mark.slow
def test_profile_prefill_compares_the_worker_with_its_floor(tmp_path):
    out = run("profile_prefill.py", ["--model", "tiny-random", "--tokens", "600", "--chunk", "64", "--repeats", "1"],
              tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for text in ("| worker (tiercache serve's steps) |", "| tiered (tiercache.generate's prefill) |",
                 "| floor (model(ids), chunks of 64, DynamicCache) | ", "| one shot (model(ids), DynamicCache) |"):
        assert text in out.stdout, f"{text!r} missing:\n{out.stdout[-3000:]}"
    # the worker's cache is reserved for the prompt: its prefill regrows (copies) nothing
    assert "worker: regrowth copied 0.0 MiB per prefill" in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
def test_profile_turn_breaks_a_stored_turn_down(tmp_path):
    import re

    out = run("profile_turn.py", ["--model", "tiny", "--history", "300", "--turns", "2", "--turn-tokens", "4",
                                  "--repeats", "1"], tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for text in ("| store: checkout (radix match, take / fork, retier) |", "| forward: attention kernel (SDPA) |",
                 "| **time to first token** |", "next turn sent the moment the previous answer is done"):
        assert text in out.stdout, f"{text!r} missing:\n{out.stdout[-3000:]}"
    # the timed turns reuse the stored conversation: each next turn and the branch find it
    for kind in ("next", "at once", "branch"):
        prompt, cached = map(int, re.search(rf"  {kind} turn: (\d+) prompt tokens \((\d+) cached\)", out.stdout).groups())
        assert 0 < cached < prompt, out.stdout[-3000:]
