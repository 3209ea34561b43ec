"""Where the milliseconds of one ``tiercache serve`` step go, at 8 and 16 users (decode steps).

    python bench/profile_step.py [--model smollm2-135m] [--users 8,16] [--context 128] [--steps 12]
                                 [--threads 1] [--no-live] [--json out/profile_step.json]

In this process: the server's own worker (``tiercache.serve.server.build``, no store, ``--max-active``
the number of users), fed N completions of ``--context`` prompt tokens (greedy; end-of-text
banned through ``logit_bias`` so all N keep decoding); every event goes through the app's
``_Pipe`` to an asyncio loop on another thread, as in the server. Once every sequence decodes,
``--steps`` steps of the worker (its ``_step``, called from here; its thread is not started) are
measured three ways:

1. **Breakdown** (exclusive wall time per part, ms per step; timers wrapped around the parts for
   that pass only): matmuls (every ``nn.Linear``: q/k/v/o, MLP, LM head), the attention kernel
   (``scaled_dot_product_attention``), the attention glue (the rest of the attention modules:
   RoPE, the per-row split, masks, copies), cache updates (``TieredCache.update`` of the rows on
   their own, ``StepWorkspace.write`` of the joined decoding rows), the rest of
   the model (embedding, norms, activations, residuals, module calls), packing the rows
   (``run_rows`` outside the model), sampling (``Sampler.pick`` / ``take``), per-sequence Python
   (``Sequence.row`` / ``advance`` outside sampling and events: detokenizing, stop checks), events
   (``emit``: the hand-off to the event loop), and the step's own bookkeeping. The timers' own
   cost shows as the step time with timers against the plain one.
2. **torch.profiler**: the operators with the most self CPU time per step.
3. **cProfile**: the Python functions with the most own time per step, with calls per step (what
   grows with layers x sequences).

Then (unless ``--no-live``) **the event loop and HTTP**: a live ``tiercache serve`` with N
streamed completions through the ``openai`` client; the median gap between two tokens of a
stream while all N decode is the step period a client sees; less the in-process step time, it is
what the HTTP side (uvicorn, the event loop, SSE, GIL contention with the worker) adds per step.
The CPU may be shared: the load average is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from serve_load import stream, text_of  # a sibling module: bench/ is on the path of a script run from it

PARTS = ("matmuls (nn.Linear)", "attention kernel (SDPA)", "attention glue (RoPE, per-row split, masks)",
         "cache updates (TieredCache.update, StepWorkspace.write)", "rest of the model (embedding, norms, MLP act., residuals)",
         "packing rows (run_rows outside the model)", "sampling (Sampler)", "per-sequence Python (row/advance)",
         "events (emit to the event loop)", "step bookkeeping (rest of _step)")


class Timers:
    """Exclusive wall time per label: time inside a label less the time in labels nested in it."""

    def __init__(self):
        self.total = defaultdict(float)
        self._stack = []  # [label, start, time in children]

    def enter(self, label):
        self._stack.append([label, time.perf_counter(), 0.0])

    def leave(self):
        label, start, children = self._stack.pop()
        spent = time.perf_counter() - start
        self.total[label] += spent - children
        if self._stack:
            self._stack[-1][2] += spent

    def wrap(self, label, fn):
        def timed(*a, **k):
            self.enter(label)
            try:
                return fn(*a, **k)
            finally:
                self.leave()
        return timed


@contextlib.contextmanager
def patched(obj, name, make):
    """``obj.name`` replaced by ``make(original)`` inside; nothing when ``obj`` has no ``name``."""
    if not hasattr(obj, name):
        yield False
        return
    before = obj.__dict__.get(name, None) if isinstance(obj, type) else getattr(obj, name)
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield True
    finally:
        if before is None and isinstance(obj, type):
            delattr(obj, name)
        else:
            setattr(obj, name, before)


@contextlib.contextmanager
def timed_parts(worker, timers: Timers):
    """Every part of ``PARTS`` timed by ``timers`` (hooks on the model's modules, wrappers elsewhere)."""
    import torch.nn.functional as F

    from tiercache.cache.tiered import TieredCache
    from tiercache.serve import sampling, sequence
    from tiercache.serve.workspace import StepWorkspace
    from tiercache.serve import worker as worker_mod

    model, hooks = worker.model, []

    def hook(label, module):
        hooks.append(module.register_forward_pre_hook(lambda *_: timers.enter(label)))
        hooks.append(module.register_forward_hook(lambda *_: timers.leave()))

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hook(PARTS[0], module)
        elif name.endswith("self_attn"):
            hook(PARTS[2], module)
    hook(PARTS[4], model)
    with contextlib.ExitStack() as stack:
        def wrap(obj, name, label):
            stack.enter_context(patched(obj, name, lambda fn: timers.wrap(label, fn)))

        wrap(F, "scaled_dot_product_attention", PARTS[1])
        wrap(TieredCache, "update", PARTS[3])
        wrap(StepWorkspace, "write", PARTS[3])
        wrap(worker_mod, "run_rows", PARTS[5])
        for name in ("pick", "take"):
            wrap(sampling.Sampler, name, PARTS[6])
        for name in ("row", "advance"):
            wrap(sequence.Sequence, name, PARTS[7])
        for seq in worker._active:
            wrap(seq.job, "emit", PARTS[8])
        wrap(worker, "_step", PARTS[9])
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


class EventLoop:
    """An asyncio loop on its own thread; ``pipe()`` makes the app's ``_Pipe`` on it, drained the way
    a response drains it (each event encoded as a JSON chunk)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def pipe(self):
        from tiercache.serve.app import _Pipe

        async def make():
            p = _Pipe()
            self.loop.create_task(self._drain(p))
            return p
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(30)

    @staticmethod
    async def _drain(p):
        while True:
            kind, data = await p.queue.get()
            json.dumps({"kind": kind, **{k: v for k, v in data.items() if isinstance(v, (str, int, float, dict))}})

    def close(self):
        async def cancel():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_users(worker, loop: EventLoop, n: int, context: int, new_tokens: int, chars_per_token: int) -> None:
    from tiercache.serve.protocol import Request

    ban = {t: -100.0 for t in worker.codec.eos_ids}
    for i in range(n):
        req = Request(kind="completion", model=worker.model_name, prompt=text_of(context * chars_per_token, 997 * i),
                      max_tokens=new_tokens, temperature=0.0, logit_bias=ban)
        worker.submit(worker.prepare(req, loop.pipe().emit))
    worker._admit()
    for _ in range(10 * n * (context // worker.prefill_chunk + 1)):  # prefill every prompt
        if not any(s.prefilling for s in worker._active):
            break
        worker._step()
    if len(worker._active) != n or any(s.prefilling for s in worker._active):
        raise SystemExit(f"profile: {len(worker._active)} of {n} sequences decoding after the prefill")


def measure(worker, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        worker._step()
        times.append(time.perf_counter() - t)
    return times


def profile_users(args, n: int) -> dict:
    from tiercache.serve.server import build

    _, worker = build(args.model, no_store=True, max_active=n, device="cpu")
    loop = EventLoop()
    try:
        prefill_steps = n * (args.context // worker.prefill_chunk + 2)  # the first ones decode meanwhile
        start_users(worker, loop, n, args.context, 4 * args.steps + 8 + prefill_steps, args.chars_per_token)
        measure(worker, 2)  # warm-up
        plain = measure(worker, args.steps)
        timers = Timers()
        with timed_parts(worker, timers):
            with_timers = measure(worker, args.steps)
        parts = {p: timers.total[p] * 1e3 / args.steps for p in PARTS}
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            measure(worker, args.steps)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
        top_ops = [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3 / args.steps, "calls": e.count / args.steps}
                   for e in ops]
        prof_py = cProfile.Profile()
        prof_py.enable()
        measure(worker, args.steps)
        prof_py.disable()
        stats = pstats.Stats(prof_py).stats
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        top_py = [{"function": f"{Path(f).name}:{line} {fn}", "own_ms": tt * 1e3 / args.steps, "calls": nc / args.steps,
                   "cumulative_ms": ct * 1e3 / args.steps} for (f, line, fn), (_, nc, tt, ct, _) in rows]
        if len(worker._active) != n:
            raise SystemExit(f"profile: {n - len(worker._active)} sequence(s) ended during the profile")
    finally:
        loop.close()
    return {"users": n, "step_ms": statistics.median(plain) * 1e3, "step_ms_with_timers": statistics.median(with_timers) * 1e3,
            "parts_ms": parts, "top_ops": top_ops, "top_python": top_py}


def live_period(args, n: int, tmp: Path) -> dict:
    """Median gap between two tokens of a stream while ``n`` streams decode, on a live server."""
    from tiercache.serve.launch import LiveServer

    server = LiveServer("--model", args.model, "--no-store", "--max-active", str(n), log_dir=tmp,
                        threads=args.threads).wait_ready()
    try:
        stream(server, args.model, text_of(64), 4)  # warm-up
        out = [None] * n
        prompts = [text_of(args.context * args.chars_per_token, 997 * i) for i in range(n)]
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, stream(server, args.model, prompts[i],
                                                                                 args.live_tokens)))
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.stop()
    start, end = max(r["times"][0] for r in out), min(r["times"][-1] for r in out)
    gaps = [b - a for r in out for a, b in zip(r["times"], r["times"][1:]) if a >= start and b <= end]
    if not gaps:
        raise SystemExit("live: the streams never decoded all at once (an end of text?); raise --live-tokens")
    return {"users": n, "period_ms": statistics.median(gaps) * 1e3, "gaps": len(gaps)}


def report(r: dict, live: dict | None) -> str:
    n, step = r["users"], r["step_ms"]
    timed = r["step_ms_with_timers"]
    lines = [f"\n### {n} users: a decode step {step:.1f} ms ({n / step * 1e3:.0f} tokens/s in process); "
             f"with the timers {timed:.1f} ms", "", "| part | ms per step | share | per sequence (ms) |",
             "|---|---:|---:|---:|"]
    for part, ms in sorted(r["parts_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {part} | {ms:.2f} | {ms / timed:.0%} | {ms / n:.2f} |")
    if live is not None:
        extra = live["period_ms"] - step
        lines.append(f"| event loop + HTTP (live server: token period {live['period_ms']:.1f} ms less the step) | "
                     f"{extra:.2f} | {extra / live['period_ms']:.0%} of the period | {extra / n:.2f} |")
        if extra < 0:
            lines.append("\n(negative: the live server's steps ran faster than the in-process ones; the machine's "
                         "load changed between the two measurements, so this row means nothing here)")
    lines += ["", "torch.profiler, the operators with the most self CPU time:", "",
              "| operator | self ms per step | calls per step |", "|---|---:|---:|"]
    lines += [f"| {o['op']} | {o['self_ms']:.2f} | {o['calls']:.0f} |" for o in r["top_ops"]]
    lines += ["", "cProfile, the Python functions with the most own time (profiler overhead included):", "",
              "| function | own ms per step | calls per step | cumulative ms |", "|---|---:|---:|---:|"]
    lines += [f"| {p['function']} | {p['own_ms']:.2f} | {p['calls']:.0f} | {p['cumulative_ms']:.1f} |"
              for p in r["top_python"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--users", default="8,16", help="comma-separated numbers of concurrent users")
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each user")
    p.add_argument("--steps", type=int, default=12, help="decode steps measured per pass")
    p.add_argument("--threads", type=int, default=1, help="torch threads (and the live server's); 0: all cores")
    p.add_argument("--top", type=int, default=12, help="rows of the operator and function tables")
    p.add_argument("--no-live", action="store_true", help="skip the live-server measurement of the event loop")
    p.add_argument("--live-tokens", type=int, default=48, help="live: new tokens of each stream")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    try:
        args.users = sorted({int(v) for v in args.users.split(",") if v.strip()})
    except ValueError:
        args.users = []
    if not args.users or min(args.users) < 1:
        p.error("--users must be comma-separated whole numbers >= 1")
    if min(args.context, args.steps, args.top, args.live_tokens) < 1 or args.threads < 0:
        p.error("--context, --steps, --top and --live-tokens must be >= 1, --threads >= 0")
    args.chars_per_token = 1 if args.model.startswith("tiny") else 4
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    print(f"profile_step ({args.model}, {args.context}-token prompts, {args.steps} decode steps per pass, "
          f"{args.threads or 'all'} torch thread(s); load average {load})", flush=True)
    result = {"model": args.model, "context": args.context, "threads": args.threads, "load_before": load, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.users:
            r = profile_users(args, n)
            live = None if args.no_live else live_period(args, n, Path(tmp))
            r["live"] = live
            result["runs"].append(r)
            print(report(r, live), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
