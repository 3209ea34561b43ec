"""Where a cold prefill's time goes in ``tiercache serve``, in this process, against its floor.

    python bench/profile_prefill.py [--model smollm2-135m] [--tokens 1400] [--chunk 256] [--repeats 2]
                                    [--threads 1] [--profile]

One prompt of ``--tokens`` tokens of held-out text, prefilled four ways, in turns, ``--repeats``
times each (the CPU may be shared: compare within one run):

1. **worker**: the server's own worker (``tiercache.serve.server.build``, no store, its default
   ``prefill_chunk``), one completion request, its steps called from here until the first token;
   also the bytes the cache's regrowth copied meanwhile (``tiercache.layers.regrowth``);
2. **tiered**: ``tiercache.cache.prefill.prefill`` into a ``TieredCache`` of the serving policy
   (what ``tiercache.generate`` runs before it decodes), chunks of ``--chunk``;
3. **floor**: plain ``model(ids)`` forwards in chunks of ``--chunk`` with transformers'
   ``DynamicCache``;
4. **one shot**: one forward of the whole prompt with a ``DynamicCache``.

Prints the median seconds of each and its ratio to the floor. ``--profile`` adds a cProfile of
one more worker prefill (the functions with the most own time).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path

import torch

from serve_load import text_of  # a sibling module: bench/ is on the path of a script run from it


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=1400)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads; 0: all cores")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    if min(args.tokens, args.chunk, args.repeats) < 1 or args.threads < 0:
        p.error("--tokens, --chunk and --repeats must be >= 1, --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from transformers import DynamicCache

    from tiercache.cache.prefill import prefill
    from tiercache.cache.tiered import TieredCache
    from tiercache.layers import regrowth
    from tiercache.serve.protocol import Request
    from tiercache.serve.server import build

    _, worker = build(args.model, no_store=True, max_active=2, device="cpu")
    model = worker.model
    ids = worker.codec.encode(text_of(args.tokens * (1 if args.model.startswith("tiny") else 4), 7))[:args.tokens]
    tensor = torch.tensor([ids])  # [1, T]
    copied = []

    def run_worker():
        req = Request(kind="completion", model=worker.model_name, prompt=ids, max_tokens=1, temperature=0.0)
        worker.submit(worker.prepare(req, lambda kind, **data: None))
        worker._admit()
        before = sum(regrowth.copied().values())
        start = time.perf_counter()
        while worker._active:
            worker._step()
        copied.append(sum(regrowth.copied().values()) - before)
        return time.perf_counter() - start

    def run_tiered():
        cache = TieredCache.from_policy(worker.policy, model.config, context_length=len(ids))
        start = time.perf_counter()
        prefill(model, tensor, cache, args.chunk)
        return time.perf_counter() - start

    @torch.no_grad()
    def run_floor(chunk):
        cache = DynamicCache()
        start = time.perf_counter()
        for a in range(0, len(ids), chunk):
            model(input_ids=tensor[:, a:a + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start

    ways = {"worker (tiercache serve's steps)": run_worker, "tiered (tiercache.generate's prefill)": run_tiered,
            f"floor (model(ids), chunks of {args.chunk}, DynamicCache)": lambda: run_floor(args.chunk),
            "one shot (model(ids), DynamicCache)": lambda: run_floor(len(ids))}
    load = lambda: " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    print(f"profile_prefill ({args.model}, {len(ids)} tokens, worker chunk {worker.prefill_chunk}, "
          f"{args.threads or 'all'} thread(s); load average {load()})")
    run_floor(args.chunk)  # warm-up
    times = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            times[name].append(fn())
    floor = statistics.median(times[list(ways)[2]])
    print("| prefill | seconds (median) | ratio to the floor |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.median(ts) / floor:.2f}x |")
    print(f"worker: regrowth copied {max(copied) / 2**20:.1f} MiB per prefill; load average after: {load()}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_worker()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
