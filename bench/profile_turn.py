"""Where the time to first token of a stored conversation's next turn goes in ``tiercache serve``.

    python bench/profile_turn.py [--model smollm2-135m] [--history 4000] [--turns 2] [--turn-tokens 16]
                                 [--repeats 3] [--threads 1] [--store PATH] [--profile] [--live]

In this process: the server's own worker with its store (``tiercache.serve.server.build``, the
default store unless ``--store``; the worker's and the store keeper's threads running, as in the
server). A chat conversation of ``--turns`` user turns of held-out text is grown to about
``--history`` tokens, each turn answered by the worker (``--turn-tokens`` greedy tokens, its
answers go into the history, as ``bench/bench_peer.py`` does). Then the timed turns, each about
48 new user tokens, timed from the request's arrival to the first text event:

- ``--repeats`` *next* turns of the conversation (the stored entry is taken), each sent 0.5 s
  after the previous answer (its closing step and ``put`` are done: the parts are the turn's own);
- ``--repeats`` more, alternating with them, sent the moment the previous answer is done (as
  ``bench_peer.py``'s client does: the previous turn's closing step is on the way);
- one *branch*: the last turn asked again with another question (the entry is forked and cropped).

Every part on the way is timed (exclusive wall time: a part less the parts nested in it), on
the thread that runs it: the request's preparation (chat template + tokenizing, the planner's
bytes), the store's calls on the keeper thread (the previous turn's ``put``, ``reserve``,
``checkout``, the room reserved for the prompt), the worker's forward (matmuls, attention
kernel, cache updates, the rest of the model, the packing around it), sampling and the first
event; what no part covers is the waits between threads. ``--profile`` adds a cProfile of the
worker thread during one more timed turn (the functions with the most own time); ``--live`` runs
the same turns against a live ``tiercache serve`` through the ``openai`` client (TTFT only).

The CPU may be shared: the load average is printed; compare parts within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from serve_load import text_of  # a sibling module: bench/ is on the path of a script run from it

CHARS_PER_TOKEN = 4


class Timeline:
    """Exclusive wall time per (label) within a window, per thread (a thread-local stack)."""

    def __init__(self):
        self.local = threading.local()
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.on = False
        self.cutoff = float("inf")  # parts that start after it (the first token) are not counted

    def wrap(self, label, fn):
        def timed(*a, **k):
            stack = getattr(self.local, "stack", None)
            if stack is None:
                stack = self.local.stack = []
            stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                start, children = stack.pop()
                spent = time.perf_counter() - start
                if stack:
                    stack[-1][1] += spent
                if self.on and start < self.cutoff:
                    self.total[label] += spent - children
                    self.calls[label] += 1
        return timed

    def reset(self):
        self.total.clear()
        self.calls.clear()
        self.cutoff = float("inf")


@contextlib.contextmanager
def patched(obj, name, make):
    original = getattr(obj, name)
    own = isinstance(obj, type) and name not in obj.__dict__
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if own:
            delattr(obj, name)
        else:
            setattr(obj, name, original)


PARTS = {
    "prepare": "request prep: chat template + tokenize (Codec.chat)",
    "need": "request prep: the planner's bytes (Worker._need)",
    "put": "store: the previous turn's put (keeper thread)",
    "reserve": "store: reserve the request's bytes",
    "checkout": "store: checkout (radix match, take / fork, retier)",
    "room": "room for the prompt (prefill.reserve: regrowth copies)",
    "linear": "forward: matmuls (nn.Linear)",
    "sdpa": "forward: attention kernel (SDPA)",
    "update": "forward: cache updates (TieredCache.update)",
    "attn": "forward: attention glue (RoPE, masks, split)",
    "model": "forward: rest of the model (embedding, norms, MLP act.)",
    "rows": "forward: packing rows (run_rows outside the model)",
    "pick": "first token: sampling (Worker._pick / Sampler)",
    "advance": "first token: advance, detokenize, emit",
    "step": "worker step bookkeeping (rest of _step)",
}


@contextlib.contextmanager
def instrumented(worker, tl: Timeline):
    import torch.nn.functional as F

    from tiercache.cache.tiered import TieredCache
    from tiercache.serve import sequence, worker as worker_mod

    hooks = []

    def hook(label, module):
        def pre(*_):
            stack = getattr(tl.local, "stack", None)
            if stack is None:
                stack = tl.local.stack = []
            stack.append([time.perf_counter(), 0.0])

        def post(*_):
            start, children = tl.local.stack.pop()
            spent = time.perf_counter() - start
            if tl.local.stack:
                tl.local.stack[-1][1] += spent
            if tl.on and start < tl.cutoff:
                tl.total[label] += spent - children
                tl.calls[label] += 1
        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post))

    for name, module in worker.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hook("linear", module)
        elif name.endswith("self_attn"):
            hook("attn", module)
    hook("model", worker.model)
    store = worker.store
    with contextlib.ExitStack() as stack:
        def wrap(obj, name, label):
            stack.enter_context(patched(obj, name, lambda fn: tl.wrap(label, fn)))

        wrap(worker.codec, "chat", "prepare")
        wrap(worker, "_need", "need")
        for name in ("put", "reserve", "checkout"):
            wrap(store, name, name)
        wrap(sequence, "reserve", "room")
        wrap(F, "scaled_dot_product_attention", "sdpa")
        wrap(TieredCache, "update", "update")
        wrap(worker_mod, "run_rows", "rows")
        wrap(worker, "_pick", "pick")
        wrap(sequence.Sequence, "advance", "advance")
        wrap(worker, "_step", "step")
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


def turn(worker, messages, max_tokens, tl=None):
    """One chat turn through the worker: (answer text, usage, seconds to the first text event)."""
    from tiercache.serve.protocol import Request

    done, first, parts, usage = threading.Event(), [], [], {}

    def emit(kind, **data):
        if kind == "delta":
            if not first and data.get("text"):
                first.append(time.perf_counter())
                if tl is not None:
                    tl.cutoff = first[0]  # the parts up to the first token
            parts.append(data.get("text", ""))
        elif kind == "done":
            usage.update(data["usage"])
            done.set()
        elif kind == "error":
            usage["error"] = data["error"]
            done.set()

    start = time.perf_counter()
    if tl is not None:
        tl.on = True
    req = Request(kind="chat", model=worker.model_name, messages=messages, max_tokens=max_tokens, temperature=0.0)
    worker.submit(worker.prepare(req, emit))
    if not done.wait(600):
        raise SystemExit("the turn did not finish in 600 s")
    if "error" in usage:
        raise SystemExit(f"the turn failed: {usage['error']}")
    if tl is not None:
        tl.on = False
    return "".join(parts), usage, (first[0] if first else time.perf_counter()) - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--history", type=int, default=4000)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads; 0: all cores")
    p.add_argument("--store", default=None, help="the store config (default: the server's default store)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--live", action="store_true", help="also the same turns against a live tiercache serve")
    args = p.parse_args(argv)
    if min(args.history, args.turns, args.turn_tokens, args.repeats) < 1 or args.threads < 0:
        p.error("--history, --turns, --turn-tokens and --repeats must be >= 1, --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from tiercache.serve.server import build

    _, worker = build(args.model, store=args.store, max_active=2, device="cpu")
    worker.start()
    load = lambda: " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    print(f"profile_turn ({args.model}, ~{args.history}-token history, {args.turns} turns, "
          f"{args.threads or 'all'} thread(s); load average {load()})", flush=True)
    try:
        turn(worker, [{"role": "user", "content": text_of(256, 3)}], 4)  # warm-up
        messages = conversation(lambda m, n: turn(worker, m, n), args)
        tl, kinds = Timeline(), {"next": [], "branch": [], "at once": []}
        with instrumented(worker, tl):
            plan = ["next", "at once"] * args.repeats + ["branch"] + (["profile"] if args.profile else [])
            for r, kind in enumerate(plan):
                # "next": the next turn of the conversation (the stored entry is taken), sent 0.5 s after
                # the previous answer (its closing step and put are done: the parts are this turn's own);
                # "at once": the same, sent the moment the previous answer is done (as bench_peer's client);
                # "branch": the last turn asked again with another question (the entry is forked and cropped)
                history = messages if kind != "branch" else messages[:-2]
                nxt = [*history, {"role": "user", "content": text_of(48 * CHARS_PER_TOKEN, 1000 + 311 * r)}]
                if kind != "at once":
                    time.sleep(0.5)
                prof = cProfile.Profile() if kind == "profile" else None
                if prof is not None:  # the worker thread's steps (cProfile sees only the thread that enables it)
                    step = worker._step

                    def profiled_step(step=step, prof=prof):
                        prof.enable()
                        try:
                            return step()
                        finally:
                            prof.disable()
                    worker._step = profiled_step
                tl.reset()
                text, usage, ttft = turn(worker, nxt, 4, tl)
                if prof is not None:
                    worker._step = step
                    print(f"cProfile of the worker's steps up to the first token of one more next turn "
                          f"(TTFT {ttft * 1e3:.0f} ms):")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
                    continue
                kinds[kind].append((ttft, dict(tl.total), dict(tl.calls)))
                if kind != "branch":
                    messages = [*nxt, {"role": "assistant", "content": text}]
                print(f"  {kind} turn: {usage['prompt_tokens']} prompt tokens "
                      f"({usage['prompt_tokens_details']['cached_tokens']} cached), TTFT {ttft * 1e3:.0f} ms",
                      flush=True)
        shown = ("next", "branch")
        print(f"\n| part of the TTFT, ms | next turn (median of {args.repeats}) | calls | a branch (fork) | calls |"
              "\n|---|---:|---:|---:|---:|")
        for key, label in PARTS.items():
            cells = []
            for kind in shown:
                runs = kinds[kind]
                cells += [f"{statistics.median(run[1].get(key, 0.0) for run in runs) * 1e3:.1f}",
                          str(runs[-1][2].get(key, 0))]
            print(f"| {label} | {' | '.join(cells)} |")
        rest = {kind: statistics.median(run[0] - sum(run[1].values()) for run in kinds[kind]) * 1e3 for kind in shown}
        ttft = {kind: statistics.median(run[0] for run in runs) * 1e3 for kind, runs in kinds.items()}
        print(f"| waits between threads, events, rest (TTFT less the parts) | {rest['next']:.1f} | | "
              f"{rest['branch']:.1f} | |")
        print(f"| **time to first token** | {ttft['next']:.1f} | | {ttft['branch']:.1f} | |")
        print(f"next turn sent the moment the previous answer is done (its closing step and put on the way): "
              f"TTFT {ttft['at once']:.1f} ms (median of {args.repeats})")
        print(f"load average after: {load()}")
    finally:
        worker.stop()
        if worker.store is not None:
            worker.store.close()
    if args.live:
        live = live_ttfts(args)
        print(f"\nlive tiercache serve (openai client, streamed): next turn TTFT {live['next']:.1f} ms "
              f"(in-process {ttft['next']:.1f}: the HTTP side adds {live['next'] - ttft['next']:.1f}); "
              f"sent at once {live['at once']:.1f} ms (in-process {ttft['at once']:.1f}); a branch {live['branch']:.1f} ms "
              f"(in-process {ttft['branch']:.1f}); load average {load()}")
    return 0


def conversation(turn_fn, args):
    """The history turns (``turn_fn(messages, max_tokens) -> (text, usage dict, ttft)``), as bench_peer grows them."""
    chars = max(64, (args.history - args.turns * (args.turn_tokens + 16)) * CHARS_PER_TOKEN // args.turns)
    base = 50000 + 7 * args.history
    messages = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": text_of(chars, base + t * chars)})
        text, usage, ttft = turn_fn(messages, args.turn_tokens)
        messages.append({"role": "assistant", "content": text})
        print(f"  turn {t + 1}: {usage['prompt_tokens']} prompt tokens "
              f"({usage['prompt_tokens_details']['cached_tokens']} cached), TTFT {ttft * 1e3:.0f} ms", flush=True)
    return messages


def live_ttfts(args) -> dict:
    """The same next turns (and one branch) against a live ``tiercache serve``: TTFT ms, medians."""
    import tempfile

    from bench_serve import timed_turn
    from tiercache.serve.launch import LiveServer

    with tempfile.TemporaryDirectory() as tmp:
        server = LiveServer("--model", args.model, "--max-active", "2", *(["--store", args.store] if args.store else []),
                            log_dir=Path(tmp), threads=args.threads or None, request_timeout=600.0)
        try:
            server.wait_ready()

            def turn_fn(messages, max_tokens):
                r = timed_turn(server, args.model, messages, max_tokens)
                return r["text"], {"prompt_tokens": r["prompt"], "prompt_tokens_details": {"cached_tokens": r["cached"]}}, r["ttft"]

            turn_fn([{"role": "user", "content": text_of(256, 3)}], 4)  # warm-up
            print("live tiercache serve:", flush=True)
            messages = conversation(turn_fn, args)
            out = {"next": [], "branch": [], "at once": []}
            for r, kind in enumerate(["next", "at once"] * args.repeats + ["branch"]):
                history = messages if kind != "branch" else messages[:-2]
                nxt = [*history, {"role": "user", "content": text_of(48 * CHARS_PER_TOKEN, 1000 + 311 * r)}]
                if kind != "at once":
                    time.sleep(0.5)
                text, usage, ttft = turn_fn(nxt, 4)
                out[kind].append(ttft * 1e3)
                if kind != "branch":
                    messages = [*nxt, {"role": "assistant", "content": text}]
                print(f"  {kind} turn: {usage['prompt_tokens']} prompt tokens "
                      f"({usage['prompt_tokens_details']['cached_tokens']} cached), TTFT {ttft * 1e3:.0f} ms", flush=True)
            return {k: statistics.median(v) for k, v in out.items()}
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
