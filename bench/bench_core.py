"""Decode speed of a full-precision TieredCache against transformers' DynamicCache, same run.

    python bench/bench_core.py [--prompt 3072] [--new 512] [--repeats 3]

The built-in tiny Llama on the CPU (or CUDA with --device cuda); each repeat runs both caches
back to back (order alternating). Decode tokens/s is timed inside ``generate``: a logits
processor stamps every step, so the prefill is excluded exactly; best of the repeats. Tokens must be identical. Prints a markdown table and the ratio
(target: >= 1.2x DynamicCache).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from tiercache import TieredCache
from tiercache.bench.tiny import load_model


def tiny_llama(device: str):
    """The project's built-in tiny Llama (tiercache.bench.tiny: trained byte-level, 4 layers, 2 KV heads x 64)."""
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
        out = model.generate(ids, past_key_values=make_cache(), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, logits_processor=LogitsProcessorList([clock]))
    return (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0]), out


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


if __name__ == "__main__":
    main()
