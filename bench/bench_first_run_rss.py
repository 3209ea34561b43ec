"""Peak memory of a first ``tiercache generate`` with an int4 policy, against its plan.

    python bench/bench_first_run_rss.py [--policy configs/int4-kivi.yaml] [--model random|tiny|DIR]
                                        [--context 8192] [--new 16] [--scenarios fresh,built,lazy]

Measured as ``bench/bench_memory.py`` measures every policy: ``--model random`` (default) is its
random-weight 8-layer Llama (hidden 256, vocab 32000, fp32, a byte-level tokenizer); the plan is
``tiercache.plan(policy, model, 1, context, device="cpu", runtime=baseline)``, the baseline being the
peak RSS of a process that imports what ``tiercache generate`` imports. Each scenario runs
``tiercache generate`` in a fresh process started by a small launcher, and reports two peaks:

- ``wait4``: the peak RSS ``os.wait4`` gives for the run (the largest process of its tree: the run
  itself, or a compiler it started; what bench_memory.py reports);
- ``tree``: the peak of the summed RSS of the run and all its descendants, sampled every 10 ms.

Scenarios:

- ``fresh``: no kernel built (``TIERCACHE_KERNEL_DIR`` an empty temporary directory): a first run
  on a new install. The run loads nothing, compiles nothing, and decodes with the torch path.
- ``built``: the kernel built ahead (``tiercache build-kernels``, in the default directory or
  ``--kernel-dir``): what every run after the build step sees. Skipped when it is not built.
- ``lazy``: no kernel built and ``TIERCACHE_KERNEL_BUILD=lazy``: the run compiles it (g++, about a
  minute), as a first int4 run did when kernels were built on first use. Off by default.

Prints one row per scenario and the ratio of each peak to the plan. Target: ``fresh`` within
1.15x of the plan.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
MiB = 2**20

from bench_memory import BASELINE, LAUNCH, child_env, run_child, write_model  # noqa: E402


def tree_rss(procs: list) -> int:
    """Resident bytes of ``procs`` and all their descendants now (those that vanish mid-read count 0)."""
    total = 0
    members = list(procs)
    for p in procs:
        try:
            members += p.children(recursive=True)
        except psutil.Error:
            pass
    for p in members:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run(args, env_extra: dict, prompt_file: Path) -> dict:
    """One ``tiercache generate`` in a fresh process: wait4's peak RSS, the tree's sampled peak, wall time."""
    env = {**child_env(), **env_extra}
    env.pop("TIERCACHE_PACKED_KERNEL", None)
    if "TIERCACHE_KERNEL_BUILD" not in env_extra:
        env.pop("TIERCACHE_KERNEL_BUILD", None)
    cmd = [sys.executable, "-m", "tiercache.cli", "generate", "--model", args.model_path, "--policy", args.policy,
           "--prompt-file", str(prompt_file), "--max-new-tokens", str(args.new), "--no-chat"]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCH, *cmd], stdout=out, stderr=err, env=env, cwd=ROOT)
        ps = psutil.Process(launcher.pid)
        peak = 0
        while launcher.poll() is None:
            try:
                peak = max(peak, tree_rss(ps.children()))  # the run and what it starts, not the launcher
            except psutil.Error:
                pass
            time.sleep(0.01)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if not last.startswith("MAXRSS") or last.split()[2] != "0" or "memory:" not in stdout:
        raise SystemExit(f"generate failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return {"tree": peak, "wait4": int(last.split()[1]) * 1024, "wall": wall,
            "warned": "tiercache build-kernels" in stderr}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="configs/int4-kivi.yaml")
    p.add_argument("--model", default="random", help="random (bench_memory.py's 8-layer Llama, default), tiny, "
                                                     "or a model directory")
    p.add_argument("--context", type=int, default=8192, help="prompt + new tokens")
    p.add_argument("--new", type=int, default=16, help="tokens generated")
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
    if args.new >= args.context:
        p.error(f"--new ({args.new}) must be less than --context ({args.context})")
    import tiercache
    from tiercache.quantize import kernel_build, packed_cpu

    built_dir = args.kernel_dir or str(kernel_build.root())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.model_path = args.model
        if args.model == "random":
            args.model_path = str(Path(tmp) / "model")
            write_model(Path(args.model_path), argparse.Namespace(vocab=32000, hidden=256, intermediate=1024,
                                                                  layers=8, heads=4, kv_heads=4, context=args.context))
        prompt = Path(tmp) / "prompt.txt"
        rnd = random.Random(0)
        prompt.write_text("".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.context - args.new)))
        baseline, _ = run_child([sys.executable, "-c", BASELINE])
        plan = tiercache.plan(args.policy, args.model_path, 1, args.context, device="cpu", runtime=baseline)
        planned = sum(plan.whole.total.values())
        print(f"runtime baseline {baseline / MiB:.1f} MiB; plan {planned / MiB:.1f} MiB (prefill chunks of "
              f"{plan.prefill_chunk})", flush=True)
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
    print(f"\n`tiercache generate --model {args.model} --policy {policy.name}`, context {args.context} "
          f"({args.context - args.new} prompt + {args.new} new), OMP_NUM_THREADS {child_env()['OMP_NUM_THREADS']}")
    print("| scenario | plan (MiB) | wait4 peak RSS (MiB) | wait4 / plan | tree peak RSS (MiB) | tree / plan | "
          "wall (s) | warned 'not built' |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, r in rows:
        print(f"| {name} | {planned / MiB:.0f} | {r['wait4'] / MiB:.0f} | {r['wait4'] / planned:.2f}x | "
              f"{r['tree'] / MiB:.0f} | {r['tree'] / planned:.2f}x | {r['wall']:.1f} | "
              f"{'yes' if r['warned'] else 'no'} |")
    for name, r in rows:
        print(f"ratio {name}: {max(r['wait4'], r['tree']) / planned:.2f}x of the plan (target for fresh: <= 1.15x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
