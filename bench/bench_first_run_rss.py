"""Peak memory of a first ``tiercache generate`` with an int4 policy, against its plan.

    python bench/bench_first_run_rss.py [--policy configs/int4-kivi.yaml] [--model tiny]
                                        [--prompt-tokens 2000] [--new 32] [--scenarios fresh,built,lazy]

Each scenario runs ``tiercache generate`` in a fresh process and samples the resident memory of
its whole process tree (the process and every child, e.g. a compiler) every 10 ms with psutil;
the plan is the planner's whole footprint that ``generate`` prints (``planned total``: weights,
activations, cache). Scenarios:

- ``fresh``: no kernel built (``TIERCACHE_KERNEL_DIR`` an empty temporary directory): a first run
  on a new install. The run loads nothing, compiles nothing, and decodes with the torch path.
- ``built``: the kernel built ahead (``tiercache build-kernels``, in the default directory or
  ``--kernel-dir``): what every run after the build step sees. Skipped when it is not built.
- ``lazy``: no kernel built and ``TIERCACHE_KERNEL_BUILD=lazy``: the run compiles it (g++, about a
  minute), as a first int4 run did when kernels were built on first use. Off by default.

Prints one row per scenario (tree peak, the process's own peak, plan, ratio of the tree peak to
the plan, wall time) and whether the run warned that no kernel was built. Target: ``fresh``
within 1.15x of the plan.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` and all its descendants now (those that vanish mid-read count 0)."""
    total = 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in members:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run(args, env_extra: dict, prompt_file: Path) -> dict:
    """One ``tiercache generate`` in a fresh process: its output, its tree's peak RSS, its wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    env.pop("TIERCACHE_PACKED_KERNEL", None)
    if "TIERCACHE_KERNEL_BUILD" not in env_extra:
        env.pop("TIERCACHE_KERNEL_BUILD", None)
    cmd = [sys.executable, "-m", "tiercache.cli", "generate", "--model", args.model, "--policy", args.policy,
           "--prompt-file", str(prompt_file), "--max-new-tokens", str(args.new), "--no-chat"]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
        ps = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(ps))
            time.sleep(0.01)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"generate failed ({proc.returncode}):\n{stdout}\n{stderr}")
    m = re.search(r"planned total ([\d.]+) MiB, peak RSS ([\d.]+) MiB", stdout)
    if m is None:
        raise SystemExit(f"no memory line in generate's output:\n{stdout}")
    return {"tree": peak, "plan": float(m.group(1)) * MiB, "own": float(m.group(2)) * MiB, "wall": wall,
            "warned": "tiercache build-kernels" in stderr}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="configs/int4-kivi.yaml")
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length in bytes (tiny: one token each)")
    p.add_argument("--new", type=int, default=32, help="tokens generated")
    p.add_argument("--scenarios", default="fresh,built", help="comma-separated: fresh, built, lazy")
    p.add_argument("--kernel-dir", default=None, help="where the 'built' scenario finds the build (default: "
                                                      "$TIERCACHE_KERNEL_DIR, else ~/.cache/tiercache/kernels)")
    args = p.parse_args(argv)
    policy = Path(args.policy) if Path(args.policy).exists() else ROOT / args.policy  # also from another directory
    if not policy.is_file():
        p.error(f"--policy: file not found: {args.policy}")
    args.policy = str(policy.resolve())
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - {"fresh", "built", "lazy"})
    if unknown:
        p.error(f"--scenarios: unknown {', '.join(unknown)}; allowed: fresh, built, lazy")
    sys.path.insert(0, str(ROOT))
    from tiercache.quantize import kernel_build, packed_cpu

    built_dir = args.kernel_dir or str(kernel_build.root())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prompt = Path(tmp) / "prompt.txt"
        text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
        prompt.write_text((text * (args.prompt_tokens // len(text) + 1))[:args.prompt_tokens])
        for name in scenarios:
            if name == "built":
                os.environ["TIERCACHE_KERNEL_DIR"] = built_dir
                if kernel_build.locate(packed_cpu.kernel()) is None:
                    print(f"built: skipped, no kernel built in {built_dir} (run `tiercache build-kernels` first)")
                    continue
                env = {"TIERCACHE_KERNEL_DIR": built_dir}
            else:
                empty = Path(tmp) / f"kernels-{name}"
                empty.mkdir()
                env = {"TIERCACHE_KERNEL_DIR": str(empty)}
                if name == "lazy":
                    env["TIERCACHE_KERNEL_BUILD"] = "lazy"
            r = run(args, env, prompt)
            rows.append((name, r))
            print(f"{name}: done in {r['wall']:.1f}s", flush=True)
    print(f"\n`tiercache generate --model {args.model} --policy {policy.name}`, {args.prompt_tokens}-token prompt, "
          f"{args.new} new tokens; RSS sampled every 10 ms over the process tree")
    print("| scenario | tree peak RSS (MiB) | process peak RSS (MiB) | plan (MiB) | tree / plan | wall (s) | "
          "warned 'not built' |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, r in rows:
        print(f"| {name} | {r['tree'] / MiB:.0f} | {r['own'] / MiB:.0f} | {r['plan'] / MiB:.0f} | "
              f"{r['tree'] / r['plan']:.2f}x | {r['wall']:.1f} | {'yes' if r['warned'] else 'no'} |")
    for name, r in rows:
        print(f"ratio {name}: {r['tree'] / r['plan']:.2f}x of the plan (target for fresh: <= 1.15x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
