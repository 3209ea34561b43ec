"""Decode speed of the quality techniques (sinks, clipping search, keys at their own bits) against
today's int4 / int2.

    python bench/bench_techniques_speed.py --model smollm2-135m --prompt 1024 --new 256

Every cache decodes the same tokens in lockstep (``bench_quantize.run``: one step of each cache
in turn, the order rotating, so load from other processes slows them alike). The techniques
change what is stored (a few exact sink tokens) and how a block's range is chosen when it is
packed (once per block), not the decode path, so the target is: no more than 5% slower than
the plain int4 KIVI policy. Decode at least ``residual_length`` (128) steps, better a multiple:
sinks shift the residual's phase (after a 1024-token prompt the sink-free layers hold 0 tokens
in the residual, the ones with 4 sinks hold 124 and flush 4 steps later), and the per-step cost
grows with the residual, so shorter runs compare different phases. Prints tokens/s, the ratio to plain int4, bytes held and the max
relative logit error against full precision.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tiercache
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quantize import mib, rel, run  # noqa: E402

from tiercache.bench import setups  # noqa: E402
from research import texts
from tiercache.models.load import load_model  # noqa: E402

K = {"backend": "native", "group_size": 64, "residual_length": 128}
CACHES = {
    "int4 (today)": {**K, "bits": 4},
    "int4 +sinks +clip": {**K, "bits": 4, "sink_tokens": 4, "clip": "mse"},
    "int2 (today)": {**K, "bits": 2},
    "int2 +sinks +clip": {**K, "bits": 2, "sink_tokens": 4, "clip": "mse"},
    "int2 +sinks": {**K, "bits": 2, "sink_tokens": 4},
    "int4 +sinks": "int4-sinks.yaml",
    "int4 +sinks meta8": {**K, "bits": 4, "sink_tokens": 4, "meta_bits": 8},  # scales and offsets as bytes
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--caches", default=",".join(CACHES),
                    help=f"comma-separated, 'int4 (today)' always included; from: {', '.join(CACHES)}")
    args = ap.parse_args(argv)
    names = ["int4 (today)"] + [n for n in args.caches.split(",") if n and n != "int4 (today)"]
    unknown = [n for n in names if n not in CACHES]
    if unknown:
        ap.error(f"unknown cache(s) {unknown}; allowed: {', '.join(CACHES)}")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    prompt = texts.token_ids(tok, "code", args.prompt)[None]  # [1, P]
    caches = {"full precision": DynamicCache(config=model.config)}
    caches.update({n: setups.factory(CACHES[n], model.config)() for n in names})
    out = run(model, caches, prompt, args.new)
    base = out["int4 (today)"]["tokens/s"]
    ref = out["full precision"]["logits"]
    print(f"{args.model}, prompt {args.prompt}, {args.new} decode steps, {torch.get_num_threads()} thread(s)\n")
    print("| cache | decode tok/s | vs int4 (today) | KV held | logits rel. error |\n|---|---|---|---|---|")
    for name, r in out.items():
        print(f"| {name} | {r['tokens/s']:.2f} | {r['tokens/s'] / base:.3f} | {mib(r['bytes'])} | "
              f"{rel(r['logits'], ref):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
