"""Per-step Python cost of the cache: a full-precision decode step of a tiny-width model.

    python bench/bench_step_overhead.py [--layers 80 8] [--context 256] [--steps 64] [--repeats 5]

A random Llama of hidden size 64 (4 heads, 2 KV heads of 16) is so narrow that the
model's arithmetic is small and the cache's own per-step work (checks, dispatch, bookkeeping)
shows. For each layer count: prefill ``--context`` tokens, then time ``--steps`` decode steps
(one token each, ``model(...)`` with the cache) for ``TieredCache`` (full precision) and
transformers' ``DynamicCache``, alternating order, best of ``--repeats``. Prints ms per step
for both and the ratio (ours / DynamicCache: the target is <= 1.0). Logits must agree.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tiercache import TieredCache
from tiercache.cache.compat import CACHE_KW


def config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def step_ms(model, make_cache, ids: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """ms per decode step after a prefill of ``ids`` [1, T]; returns it and the last logits."""
    cache = make_cache()
    with torch.no_grad():
        out = model(ids, **{CACHE_KW: cache}, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)  # [1, 1]
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, **{CACHE_KW: cache}, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        elapsed = time.perf_counter() - start
    return 1000 * elapsed / steps, out.logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[80, 8])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} thread(s)")
    print("| layers | TieredCache ms/step | DynamicCache ms/step | ratio |")
    print("|---|---|---|---|")
    for layers in args.layers:
        torch.manual_seed(0)
        cfg = config(layers)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, args.context))
        makers = {"tiered": lambda: TieredCache.from_policy({"name": "fp"}, cfg),
                  "dynamic": lambda: DynamicCache(config=cfg)}
        best = {name: float("inf") for name in makers}
        logits = {}
        for r in range(args.repeats + 1):  # the first round warms up
            for name in (list(makers) if r % 2 else list(reversed(makers))):
                ms, logits[name] = step_ms(model, makers[name], ids, args.steps)
                if r:
                    best[name] = min(best[name], ms)
        torch.testing.assert_close(logits["tiered"], logits["dynamic"])
        print(f"| {layers} | {best['tiered']:.3f} | {best['dynamic']:.3f} | {best['tiered'] / best['dynamic']:.3f} |")


if __name__ == "__main__":
    main()
