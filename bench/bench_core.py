"""Decode speed of a full-precision TieredCache against transformers' DynamicCache, same run.

    python bench/bench_core.py [--prompt 3072] [--new 512] [--repeats 3]

The built-in tiny Llama on the CPU (or CUDA with --device cuda); each repeat runs both caches
back to back (order alternating). Decode tokens/s is timed inside ``generate``: a logits
processor stamps every step, so the prefill is excluded exactly; best of the repeats. Tokens
must be identical. Prints a markdown table and the ratio (target: >= 1.2x DynamicCache).

Then a breakdown of one decode step per cache, from an instrumented extra run (kept out of the
tokens/s figures): the time in the cache's ``update`` (DynamicCache: its ``torch.cat`` of the
history; ours: writing the new token into spare capacity), the time attention (SDPA) spends
reading the returned K/V, and the rest of the model. It shows where the step goes: on a CPU
whose caches cannot hold the whole KV cache, attention over freshly written tensors (what a
``cat`` leaves behind in cache) is faster than over at-rest buffers, which offsets most of what
the ``cat`` costs.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from tiercache import TieredCache
from tiercache.models.load import load_model
from tiercache.cache.compat import cache_arg


def tiny_llama(device: str):
    """The project's built-in tiny Llama (tiercache.models.tiny: trained byte-level, 4 layers, 2 KV heads x 64)."""
    model, _ = load_model("tiny", device=device)
    return model


class StepClock(LogitsProcessor):
    """Records the time at which each generation step's logits are ready."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.device.type == "cuda":
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return scores


def decode_rate(model, make_cache, ids, new: int) -> tuple[float, torch.Tensor]:
    """Decode tokens/s between the first step (after prefill) and the last."""
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(ids, **cache_arg(make_cache()), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, logits_processor=LogitsProcessorList([clock]))
    return (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0]), out


def step_breakdown(model, make_cache, ids, new: int) -> dict[str, float]:
    """Microseconds per decode step in the cache update, in attention (SDPA), and in the rest."""
    spent = {"update": 0.0, "attention": 0.0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def timed(name, fn, decode):
        def wrapper(*args, **kwargs):
            if not decode(args):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            spent[name] += time.perf_counter() - start
            return out
        return wrapper

    cache = make_cache()
    cache.update = timed("update", cache.update, lambda a: a[0].shape[2] == 1)
    torch.nn.functional.scaled_dot_product_attention = timed("attention", sdpa, lambda a: a[0].shape[2] == 1)
    try:
        clock = StepClock()
        with torch.no_grad():
            model.generate(ids, **cache_arg(cache), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, logits_processor=LogitsProcessorList([clock]))
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    steps = len(clock.stamps) - 1
    total = clock.stamps[-1] - clock.stamps[0]
    # only one-token calls are timed: the prefill's are not decode work
    out = {name: seconds / steps * 1e6 for name, seconds in spent.items()}
    out["rest"] = total / steps * 1e6 - out["update"] - out["attention"]
    out["step"] = total / steps * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=3072)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 keeps timings stable on a shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_llama(args.device)
    ids = torch.randint(0, 256, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    caches = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        "TieredCache (full)": lambda: TieredCache.from_policy({"name": "full"}, model.config),
    }
    decode_rate(model, caches["DynamicCache"], ids[:, :256], 16)  # warm-up
    best = {name: 0.0 for name in caches}
    outs = {}
    for r in range(args.repeats):
        for name in (list(caches) if r % 2 == 0 else list(reversed(caches))):
            rate, outs[name] = decode_rate(model, caches[name], ids, args.new)
            best[name] = max(best[name], rate)
    same = torch.equal(outs["DynamicCache"], outs["TieredCache (full)"])
    ratio = best["TieredCache (full)"] / best["DynamicCache"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    print(f"device: {device}; built-in tiny Llama (4 layers, 2 kv heads x 64); prompt {args.prompt}, {args.new} new tokens, best of {args.repeats}\n")
    print("| cache | decode tokens/s |\n|---|---|")
    for name, rate in best.items():
        print(f"| {name} | {rate:.1f} |")
    print(f"\nratio TieredCache / DynamicCache: {ratio:.2f}x (target >= 1.2x); identical tokens: {same}")
    print(f"\nper decode step (µs, all {model.config.num_hidden_layers} layers; instrumented run, not in the figures above)\n")
    print("| cache | step | cache update | attention (SDPA) | rest of the model |\n|---|---|---|---|---|")
    for name, make in caches.items():
        b = step_breakdown(model, make, ids, args.new)
        print(f"| {name} | {b['step']:.0f} | {b['update']:.0f} | {b['attention']:.0f} | {b['rest']:.0f} |")


if __name__ == "__main__":
    main()
