"""One ``tiercache tune`` run: calibrate (or read the saved sensitivity), measure the uniform
formats, search, write the policy and the frontier.

Interface
    tune(args) -> exit code        ``args``: ``tiercache.tune.command``'s parsed flags
    TuneError                      what cannot run (the message names the flag and what is allowed)

Progress: one tqdm bar over the model forwards of the whole run (calibration trials, then each
verification's decode steps and pass-key answers), counted before the first, so that its ETA is
the run's time estimate (approximate: a stretch forward and a decode step differ in cost).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tiercache.errors import PolicyError


class TuneError(ValueError):
    """Arguments or inputs tune cannot run with."""


def _paths(args):
    out = Path(args.out)
    if out.suffix not in (".yaml", ".yml"):
        raise TuneError(f"--out {args.out}: give a .yaml path for the policy")
    if out.exists() and out.is_dir():
        raise TuneError(f"--out {args.out}: is a directory; give a .yaml file path")
    calib = Path(args.calibration) if args.calibration else out.with_suffix(".sensitivity.json")
    frontier = Path(args.frontier) if args.frontier else out.with_suffix(".frontier")
    return out, calib, frontier


class _NoBar:
    """What tune asks of a progress bar, when tqdm (the ``bench`` extra) is not installed."""

    def __init__(self, total):
        self.n, self.total = 0, total

    def update(self, n):
        self.n += n

    def set_postfix_str(self, *a, **k):
        pass

    def refresh(self):
        pass

    def close(self):
        pass


def _bar(total: int, disable: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar(total)
    return tqdm(total=total, desc="tune", unit="fwd", disable=disable, dynamic_ncols=True, file=sys.stderr)


def tune(args) -> int:
    from tiercache.models.spec import ModelSpec
    from tiercache.planner.mixed import Sensitivity
    from tiercache.policy.schema import Policy, load_policy
    from tiercache.tune import calibrate, report, search
    from tiercache.tune.inputs import UNIFORM_NAMES, setup
    from tiercache.tune.verify import Verifier

    started, cpu = time.monotonic(), time.process_time()
    deadline = None if args.time_budget is None else started + args.time_budget
    out, calib_path, frontier_path = _paths(args)
    sens = None
    if calib_path.is_file():
        try:
            sens = Sensitivity.load(calib_path)
        except PolicyError as e:
            raise TuneError(str(e)) from None
        if sens.meta.get("model") not in (None, args.model):
            raise TuneError(f"--calibration {calib_path}: measured on model {sens.meta.get('model')!r}, not "
                            f"{args.model!r}; give another file or delete it to calibrate again")
    try:
        model, tok, wins, source = setup(args)
    except ValueError as e:
        raise TuneError(str(e)) from None
    spec = ModelSpec.from_config(model.config)
    if sens is not None and any(not 0 <= l < spec.num_layers for l in sens.layers):
        raise TuneError(f"--calibration {calib_path}: its layers {list(sens.layers)} do not fit {args.model}'s "
                        f"{spec.num_layers} layers")
    base = Policy.from_dict({"name": out.stem, "description": f"tuned by tiercache tune for {args.model}"})
    uniforms = {b: search.uniform(b, spec, args.batch, args.context, base) for b in search.UNIFORM_BITS}
    budget = args.budget
    if isinstance(budget, str):
        budget = uniforms[UNIFORM_NAMES[budget]].bytes
    smallest = min(u.bytes for u in uniforms.values())
    if budget is not None and budget < smallest * 0.9:
        raise TuneError(f"--budget {budget} bytes is below what any candidate needs at --context {args.context}, "
                        f"--batch {args.batch} (uniform int2: {smallest} bytes); raise it or offload (tiercache plan)")

    passkey = not args.no_passkey
    layers = calibrate.full_attention_layers(model)
    n_cal = 0 if sens is not None else calibrate.trials(len(layers), calibrate.BITS, args.sinks, args.residual)
    from tiercache.tune.metrics import ANSWER_TOKENS, DEPTHS

    per_verify = args.stretch - 1 + (len(DEPTHS) * (1 + ANSWER_TOKENS) if passkey else 0)
    # a uniform format over the budget cannot be chosen: it is on the frontier by its bytes, unmeasured
    candidates = [u for u in uniforms.values() if budget is None or u.bytes <= budget]
    bar = _bar(n_cal + per_verify * (len(candidates) + 1), args.no_progress)

    def tick(n=1, label=None):
        bar.update(n)
        if label:
            bar.set_postfix_str(label, refresh=False)
        if deadline is not None and time.monotonic() > deadline:
            raise calibrate.TimeBudgetExceeded(f"--time-budget {args.time_budget:g} s passed ({label or 'verifying'}); "
                                               "raise it, lower --context / --stretch, or reuse --calibration")

    try:
        if sens is None:
            bar.set_postfix_str("full-precision prefix")
            sens = calibrate.calibrate(model, wins[0], args.stretch, sinks=args.sinks, residual=args.residual,
                                       tick=tick, deadline=deadline)
            sens.meta.update(model=args.model, text=source, context=args.context)
            calib_path.parent.mkdir(parents=True, exist_ok=True)
            sens.save(calib_path)
        verifier = Verifier(model, tok, wins[-1], args.stretch, passkey=passkey, tick=tick)

        def measure(policy):
            bar.set_postfix_str(f"verifying {policy.name}", refresh=False)
            return verifier.measure(policy)

        for u in candidates:
            u.figures = measure(u.policy)
        chosen, tried = search.search(sens, spec, args.batch, args.context, base, measure, budget=budget,
                                      max_kld=args.max_kld, uniforms=list(uniforms.values()), name=out.stem)
    except calibrate.TimeBudgetExceeded as e:
        bar.close()
        raise TuneError(str(e)) from None
    bar.close()
    seconds, cpu = time.monotonic() - started, time.process_time() - cpu
    points = sorted(list(uniforms.values()) + tried, key=lambda p: p.bytes)
    if chosen is None:
        print(report.table(points), file=sys.stdout)
        raise TuneError("no policy meets the request; the frontier above shows what was measured")
    request = (f"budget {budget} bytes" + (f" ({args.budget} uniform)" if isinstance(args.budget, str) else "")
               if budget is not None else f"max KLD {args.max_kld}")
    final = Policy.from_dict({**chosen.policy.to_dict(), "name": out.stem,
                              "description": f"tiercache tune: {args.model} at {args.context} tokens, {request}"})
    lines = report.header(args.model, source, args.context, args.batch, request, chosen, seconds)
    if chosen.kind == "uniform":
        lines.insert(1, f"{chosen.name} measured better than every tuned choice within the request")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.policy_yaml(final, lines))
    load_policy(out)  # what was written reads back
    meta = {"model": args.model, "context": args.context, "batch": args.batch, "request": request, "text": source,
            "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "calibration": str(calib_path),
            "title": f"tiercache tune: {args.model} at {args.context} tokens ({request})"}
    paths = report.write_frontier(points, frontier_path, meta, reference=uniforms[8])
    print(report.table(points, uniforms[8]))
    ok = chosen.meets(args.max_kld) and (budget is None or chosen.bytes <= budget)
    print(f"{'chose' if ok else 'best found (misses the request)'}: {chosen.name} ({chosen.kind}), "
          f"{chosen.bytes} bytes; {report.figures_text(chosen.figures)}")
    print(f"policy: {out}\nsensitivity: {calib_path}\nfrontier: {paths['md']}, {paths['png'] or 'no plot (matplotlib missing)'}\n"
          f"tune took {seconds:.1f} s wall, {cpu:.1f} s CPU (calibration {sens.meta.get('seconds', 0)} s wall"
          f"{', read from file' if n_cal == 0 else ''})")
    return 0 if ok else 1
