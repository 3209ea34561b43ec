"""The frontier ``tiercache tune`` finds: uniform int8 / int4 / int2 and tuned policies at three
budgets (uniform int4's bytes, halfway between int4 and int2, uniform int2's bytes), with the time
tune took, for the built-in tiny model and SmolLM2-135M.

    python bench/bench_tune.py                                   # tiny at 2048 tokens, then SmolLM2-135M at 4096
    python bench/bench_tune.py --models tiny --contexts 2048     # the tiny model only
    python bench/bench_tune.py --models smollm2-135m --contexts 4096 --no-cli

Per model: one calibration (timed, wall and CPU), the uniform formats and each tuned policy
measured on the verification text (the held-out text's second window: tune never calibrates on
it): KLD against full precision, perplexity change, top-1 agreement, pass-key retrieval; the
ratios the targets name (tuned KLD over uniform's at int4's and int2's bytes; perplexity change
over uniform int2's). Then the whole ``tiercache tune`` command once, at uniform int4's bytes, in a
fresh process (``--no-cli`` skips it), for its wall and CPU time, and ``tiercache check`` once.
Writes ``<out>/<model>.md`` / ``.json`` / ``.png``, the sensitivity
(``<model>.sensitivity.json``, read again with ``--reuse-calibration``), each tuned policy as tune
writes it (``<model>-tuned-<budget>.yaml``) and the figures so far (``<model>.partial.json``).
``--reference MODEL=POLICY`` measures a policy (e.g. a hand-made one) and tunes at its bytes too. Timings on a shared CPU are noisy: the CPU
seconds say how much of the wall time was this run's own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's tiercache

from tiercache.models.load import load_model  # noqa: E402
from tiercache.models.spec import ModelSpec  # noqa: E402
from tiercache.planner.mixed import Sensitivity  # noqa: E402
from tiercache.policy.schema import Policy, load_policy  # noqa: E402
from tiercache.tune import calibrate, report, search, text  # noqa: E402
from tiercache.tune.verify import Verifier  # noqa: E402


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_command(argv: list[str]) -> tuple[int, float, float, str]:
    """(exit code, wall s, CPU s, output tail) of ``python -m tiercache.cli ...`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cpu0, t0 = _children_cpu(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tiercache.cli", *argv], capture_output=True, text=True, env=env)
    return done.returncode, time.monotonic() - t0, _children_cpu() - cpu0, (done.stdout + done.stderr)[-600:]


def run_model(name: str, context: int, stretch: int, out: Path, cli: bool, passkey: bool,
              reference: str | None = None, reuse: bool = False, threads: int = 0) -> dict:
    model, tok = load_model(name)
    wins, source = text.windows(tok, None, context, 2)
    spec = ModelSpec.from_config(model.config)
    base = Policy.from_dict({"name": "tuned"})
    saved = out / f"{name}.sensitivity.json"
    if reuse and saved.is_file():
        sens = Sensitivity.load(saved)
        calib = {"wall_s": sens.meta.get("seconds"), "cpu_s": sens.meta.get("cpu_seconds"), "read_from": str(saved)}
    else:
        t0, c0 = time.monotonic(), time.process_time()
        count = [0]

        def tick(n, label):
            count[0] += n
            if count[0] % 20 == 0:
                print(f"  calibration: {count[0]} forwards, {time.monotonic() - t0:.0f} s", flush=True)

        sens = calibrate.calibrate(model, wins[0], stretch, tick=tick)
        calib = {"wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - c0}
        sens.meta.update(model=name, context=context, cpu_seconds=round(calib["cpu_s"], 1))
        sens.save(saved)
    print(f"{name}: calibration {calib['wall_s']:.1f} s wall, {calib['cpu_s']:.1f} s CPU", flush=True)
    verifier = Verifier(model, tok, wins[-1], stretch, passkey=passkey)
    uniforms = {b: search.uniform(b, spec, 1, context, base) for b in search.UNIFORM_BITS}
    budgets = {"int4": uniforms[4].bytes, "int3": (uniforms[4].bytes + uniforms[2].bytes) // 2, "int2": uniforms[2].bytes}
    ref_point = None
    if reference:
        rp = load_policy(reference)
        ref_point = search.Point(f"reference {Path(reference).stem}", "reference", rp, search.cache_bytes(rp, spec, 1, context))
        budgets["reference"] = ref_point.bytes
    tuned, searches, partial = {}, {}, out / f"{name}.partial.json"

    def save_partial():  # the figures so far, should a long run be stopped
        rows = [{"name": p.name, "kind": p.kind, "bytes": p.bytes, **p.figures.row()}
                for p in list(uniforms.values()) + list(tuned.values()) + [ref_point] if p is not None and p.figures]
        partial.write_text(json.dumps({"calibration": calib, "rows": rows}, indent=1, default=str) + "\n")

    def write_policy(point, label):  # as tiercache tune writes it: the header gives the measured figures
        request = f"budget {budgets[label]} bytes ({label})"
        final = Policy.from_dict({**point.policy.to_dict(), "name": f"tuned-{label}",
                                  "description": f"tiercache tune: {name} at {context} tokens, {request}"})
        lines = report.header(name, source, context, 1, request, point, None)
        lines.insert(1, f"stretch {stretch} tokens scored; calibration {calib['wall_s']:.0f} s wall")
        (out / f"{name}-tuned-{label}.yaml").write_text(report.policy_yaml(final, lines))

    def measure_uniform(b):
        u = uniforms[b]
        u.figures = verifier.measure(u.policy)
        print(f"  {u.name}: {report.figures_text(u.figures)}", flush=True)
        save_partial()

    def tune_at(label):
        t1, c1 = time.monotonic(), time.process_time()
        chosen, tried = search.search(sens, spec, 1, context, base, verifier.measure, budget=budgets[label],
                                      name=f"tuned@{label}")
        searches[label] = {"wall_s": time.monotonic() - t1, "cpu_s": time.process_time() - c1}
        tuned[label] = tried[0]  # the tuned point itself (the chosen one may be a uniform that measured better)
        write_policy(tried[0], label)
        print(f"  tuned@{label} ({tried[0].bytes} B <= {budgets[label]}): {report.figures_text(tried[0].figures)}",
              flush=True)
        save_partial()

    # what the targets compare first, so that a stopped run still holds them
    measure_uniform(4)
    measure_uniform(2)
    tune_at("int4")
    tune_at("int2")
    if ref_point is not None:
        ref_point.figures = verifier.measure(ref_point.policy)
        print(f"  {ref_point.name} ({ref_point.bytes} B): {report.figures_text(ref_point.figures)}", flush=True)
        save_partial()
        tune_at("reference")
    measure_uniform(8)
    tune_at("int3")
    points = sorted(list(uniforms.values()) + list(tuned.values()) + ([ref_point] if ref_point else []),
                    key=lambda p: p.bytes)
    ratios = {
        "kld_tuned_over_uniform_at_int4": tuned["int4"].figures.kld / uniforms[4].figures.kld,
        "kld_tuned_over_uniform_at_int2": tuned["int2"].figures.kld / uniforms[2].figures.kld,
        "ppl_change_tuned_over_uniform_at_int2": (tuned["int2"].figures.ppl_change / uniforms[2].figures.ppl_change
                                                  if uniforms[2].figures.ppl_change > 0 else None),
    }
    if ref_point is not None:
        ratios["kld_tuned_over_reference"] = tuned["reference"].figures.kld / ref_point.figures.kld
        ratios["ppl_change_tuned_minus_reference"] = tuned["reference"].figures.ppl_change - ref_point.figures.ppl_change
    meta = {"model": name, "context": context, "stretch": stretch, "text": source, "calibration": calib,
            "search_and_verify": searches, "ratios": ratios, "sensitivity_meta": sens.meta,
            "title": f"tiercache tune frontier: {name} at {context} tokens (KLD on text tune did not calibrate on)"}
    if cli:
        d = out / f"{name}-cli"
        code, wall, cpu, tail = timed_command(["tune", "--model", name, "--context", str(context), "--budget", "int4",
                                               "--stretch", str(stretch), "--out", str(d / "tuned.yaml"),
                                               "--no-progress", "--threads", str(threads)]
                                              + ([] if passkey else ["--no-passkey"]))
        meta["tune_command"] = {"exit": code, "wall_s": wall, "cpu_s": cpu}
        print(f"  tiercache tune (whole command, budget int4): exit {code}, {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        if code == 0:
            code, wall, cpu, _ = timed_command(["check", str(d / "tuned.yaml"), "--model", name, "--context",
                                                str(context), "--stretch", str(stretch), "--threads", str(threads)])
            meta["check_command"] = {"exit": code, "wall_s": wall, "cpu_s": cpu}
            print(f"  tiercache check: exit {code}, {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        else:
            print(tail)
    paths = report.write_frontier(points, out / name, meta, reference=uniforms[8])
    print()
    print(report.table(points, uniforms[8]))
    print("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items() if v is not None))
    print(f"table: {paths['md']}  plot: {paths['png']}\n", flush=True)
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2-135m")
    p.add_argument("--contexts", default="2048,4096", help="one per model, in the same order")
    p.add_argument("--stretch", type=int, default=128)
    p.add_argument("--out", default="out/bench_tune")
    p.add_argument("--no-cli", action="store_true", help="skip timing the tune / check commands in a fresh process")
    p.add_argument("--no-passkey", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--reference", action="append", default=[], metavar="MODEL=POLICY",
                   help="also measure POLICY on MODEL and tune at its bytes (e.g. a hand-made policy)")
    p.add_argument("--reuse-calibration", action="store_true",
                   help="read <out>/<model>.sensitivity.json when it exists instead of calibrating again")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if len(contexts) != len(models):
        p.error(f"--contexts gives {len(contexts)} lengths for {len(models)} models; give one per model")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared machine: timings are noisy)")
    refs = dict(r.split("=", 1) for r in args.reference)
    summary = {m: run_model(m, c, args.stretch, out, not args.no_cli, not args.no_passkey, refs.get(m),
                            args.reuse_calibration, args.threads) for m, c in zip(models, contexts)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
