"""Every stream-ordering call under ``tiercache/`` is needed by a CPU test: a mutation run.

    python bench/mutate_ordering.py [--list] [--only N] [--timeout S]

Finds each ``wait_event`` / ``wait_stream`` / ``record_stream`` / event or stream ``synchronize``
call under ``tiercache/`` (not the simulated device, which implements them, nor the CUDA
runtime's one-line wrappers, nor ``tiercache/bench``, whose syncs time benchmarks), then, one at
a time, copies the tree to a temporary directory, replaces that call by ``pass`` and runs the
offload and simulated-device tests there (``TESTS``, ``-x``). A mutant is *caught* when a test
fails. Prints a markdown table (call, caught / missed, the first failing test) and exits 1 when
one is missed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL = re.compile(r"\.(wait_event|wait_stream|synchronize)\(|record_stream\(")
SKIP = {"tiercache/runtime.py"}
TESTS = [
    "tests/offload/test_simdevice.py",
    "tests/offload/test_simdevice_decode.py",
    "tests/offload/test_lifecycle_pending.py",
    "tests/offload/test_writeback_order.py",
]


def calls() -> list[tuple[str, int, str]]:
    """(path, line number, line) of every ordering call site."""
    out = []
    for path in sorted((ROOT / "tiercache").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in SKIP or rel.startswith(("tiercache/bench/", "tiercache/simdevice/")):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if CALL.search(code) and not code.lstrip().startswith(("def ", '"', "'")) and "``" not in code:
                out.append((rel, n, line))
    return out


def mutant(tmp: Path, rel: str, n: int) -> None:
    """Replace the statement on line ``n`` by ``pass`` (same indentation)."""
    path = tmp / rel
    lines = path.read_text().splitlines(keepends=True)
    line = lines[n - 1]
    indent = line[: len(line) - len(line.lstrip())]
    stmt = line.strip()
    if stmt.startswith(("for ", "if ", "with ")) and ":" in stmt:  # a one-line compound: keep the header
        head = stmt[: stmt.index(":") + 1]
        lines[n - 1] = f"{indent}{head} pass\n"
    else:
        lines[n - 1] = f"{indent}pass  # mutated\n"
    path.write_text("".join(lines))


def run(rel: str, n: int, timeout: int) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="tiercache-mutant-") as d:
        tmp = Path(d)
        for part in ("tiercache", "tests", "configs"):
            shutil.copytree(ROOT / part, tmp / part, ignore=shutil.ignore_patterns("__pycache__"))
        mutant(tmp, rel, n)
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS],
                                  cwd=tmp, env={"PYTHONPATH": str(tmp), "PATH": "/usr/bin:/bin"},
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return True, "timeout (a hang counts as caught)", time.perf_counter() - start
        took = time.perf_counter() - start
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)  # ERROR: a hazard seen at teardown
        if proc.returncode == 0:
            return False, "", took
        return True, failed[0] if failed else proc.stdout.strip().splitlines()[-1], took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="only list the calls")
    ap.add_argument("--only", type=int, help="run only call number N (1-based)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant run")
    args = ap.parse_args()
    found = calls()
    print(f"{len(found)} ordering calls under tiercache/ (tests: {' '.join(TESTS)})\n")
    print("| # | call | result | first failing test | s |")
    print("|---|---|---|---|---|")
    missed = 0
    for i, (rel, n, line) in enumerate(found, 1):
        if args.only is not None and i != args.only:
            continue
        where = f"`{rel}:{n}` `{line.strip()}`"
        if args.list:
            print(f"| {i} | {where} | | | |")
            continue
        caught, test, took = run(rel, n, args.timeout)
        missed += not caught
        print(f"| {i} | {where} | {'caught' if caught else '**missed**'} | {test} | {took:.0f} |", flush=True)
    if not args.list:
        print(f"\n{len(found) - missed if args.only is None else int(not missed)} caught, {missed} missed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
