"""Per-step Python cost of the cache: a full-precision decode step of a tiny-width model.

    python bench/bench_step_overhead.py [--layers 80 8] [--context 256] [--steps 400]

A random Llama of hidden size 64 (4 heads, 2 KV heads of 16) is so narrow that the
model's arithmetic is small and the cache's own per-step work (checks, dispatch, bookkeeping)
shows. For each layer count, ``TieredCache`` (full precision) and transformers' ``DynamicCache``
are both prefilled with ``--context`` tokens, then decode **interleaved**: one step with one cache,
one with the other (the order swapped every pair), each step timed on its own, ``--steps`` pairs
after a warm-up. A machine that slows down or speeds up during the run (other processes, clock
changes) then slows both caches alike, where blocks of
one cache's steps at a time would not (on a shared VM those swung the ratio by +-10% between runs). Prints the median ms per step of
each, the ratio of the medians and the median of the per-pair ratios (ours / DynamicCache: the
target is <= 1.0). Both caches see the same tokens; their logits must agree.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tiercache import TieredCache
from tiercache.cache.compat import CACHE_KW


def config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def interleaved(model, caches: dict, ids: torch.Tensor, steps: int, warmup: int) -> tuple[dict, list, dict]:
    """Prefills every cache with ``ids`` [1, T], then ``warmup + steps`` rounds of one decode step
    per cache (the order reversed every round, the same token fed to each); returns the per-step ms
    of each cache (warm-up dropped), the per-round ratios (first cache / second) and the last logits."""
    names = list(caches)
    times = {name: [] for name in names}
    ratios, logits = [], {}
    with torch.no_grad():
        token = None
        for name in names:
            out = model(ids, **{CACHE_KW: caches[name]}, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)  # [1, 1]
        for r in range(warmup + steps):
            step = {}
            for name in (names if r % 2 else names[::-1]):
                start = time.perf_counter()
                out = model(token, **{CACHE_KW: caches[name]}, use_cache=True)
                step[name] = time.perf_counter() - start
                logits[name] = out.logits
            token = out.logits[:, -1:].argmax(-1)
            if r >= warmup:
                for name in names:
                    times[name].append(1000 * step[name])
                ratios.append(step[names[0]] / step[names[1]])
    return times, ratios, logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[80, 8])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=400, help="timed rounds (one step of each cache per round)")
    p.add_argument("--warmup", type=int, default=20, help="rounds before the timed ones")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} thread(s)")
    print("| layers | TieredCache ms/step (median) | DynamicCache ms/step (median) | ratio of medians | median per-step ratio |")
    print("|---|---|---|---|---|")
    for layers in args.layers:
        torch.manual_seed(0)
        cfg = config(layers)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, args.context))
        caches = {"tiered": TieredCache.from_policy({"name": "fp"}, cfg), "dynamic": DynamicCache(config=cfg)}
        times, ratios, logits = interleaved(model, caches, ids, args.steps, args.warmup)
        torch.testing.assert_close(logits["tiered"], logits["dynamic"])
        ours, theirs = statistics.median(times["tiered"]), statistics.median(times["dynamic"])
        print(f"| {layers} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.3f} | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
