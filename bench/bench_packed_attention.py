"""Decode speed of packed attention on SmolLM2-135M: int4 / int2 vs full precision and quanto.

    python bench/bench_packed_attention.py                          # contexts 1k, 4k, 8k; 16 steps
    python bench/bench_packed_attention.py --contexts 4096 --steps 24 --threads 2 --json out.json

One prefill per context (a ``DynamicCache``); every cache is then filled with that very K/V
(``TieredCache.from_legacy``: the same blocks as a prefill through it; transformers'
``QuantizedCache`` (quanto, int4, its defaults but our residual of 128) through one ``update`` per
layer, which is what its prefill does), so all decode from the same state. The caches then decode
the same greedy tokens in lockstep: one step of each in turn, the order rotating every step, so
load from other processes slows them alike (the CPU is shared: ``uptime`` is printed). Reported
per context: decode ms/step (median) and tokens/s of each cache, and ratios to tiercache full
precision and to quanto, from the same run. Caches:

- ``fp``: tiercache, no quantization (full storage);
- ``int4`` / ``int2``: native, KIVI (keys per channel, values per token), groups of 64, residual
  128, ``packed_attention`` on (decode reads the codes; ``packed_cpu`` kernel);
- ``int4-deq``: the same int4 with ``packed_attention: false`` (dequantize-then-SDPA, before);
- ``quanto``: transformers' ``QuantizedCache`` (4 bits), at the contexts in ``--quanto`` only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch
from transformers import DynamicCache

from tiercache import TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.models import registry as builtin
from tiercache.quantize import packed_cpu

Q = {"backend": "native", "group_size": 64, "residual_length": 128}
POLICIES = {
    "fp": {"name": "fp"},
    "int4": {"name": "int4", "quantize": {**Q, "bits": 4}},
    "int2": {"name": "int2", "quantize": {**Q, "bits": 2}},
    "int4-deq": {"name": "int4-deq", "quantize": {**Q, "bits": 4, "packed_attention": False}},
}


def quanto_cache(model, past):
    from transformers import QuantizedCache

    cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, residual_length=128)
    for i, (k, v) in enumerate(past):
        cache.update(k.clone(), v.clone(), i)
    return cache


def caches_for(model, past, names):
    out = {}
    for name in names:
        if name == "quanto":
            out[name] = quanto_cache(model, past)
        else:
            out[name] = TieredCache.from_legacy(past, POLICIES[name], model.config)
    return out


@torch.no_grad()
def run_context(model, ids, context: int, steps: int, names) -> dict:
    prompt = ids[:, :context]
    ref = DynamicCache(config=model.config)
    logits = model(prompt, **cache_arg(ref), use_cache=True).logits
    past = tuple((layer.keys, layer.values) for layer in ref.layers)
    caches = caches_for(model, past, names)
    del ref
    tokens, nxt = [], logits[:, -1:].argmax(-1)
    times = {name: [] for name in names}
    order = list(names)
    for name in names:  # one warm-up step each (the kernel's first load, the workspace)
        model(nxt, **cache_arg(caches[name]), use_cache=True)
    for name in names:  # the warm-up step is undone: every cache decodes from the prompt's state
        caches[name].crop(-1)
    for step in range(steps):
        tokens.append(nxt)
        for name in order:
            t0 = time.perf_counter()
            out = model(nxt, **cache_arg(caches[name]), use_cache=True).logits
            times[name].append(time.perf_counter() - t0)
            if name == "fp":
                following = out[:, -1:].argmax(-1)
        nxt = following
        order = order[1:] + order[:1]
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"context": context, "ms_per_step": ms, "tokens_per_s": {n: 1000 / m for n, m in ms.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--quanto", type=int, nargs="*", default=[4096], help="contexts at which quanto runs too")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--caches", nargs="+", default=["fp", "int4", "int2", "int4-deq"])
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = builtin.load(a.model)
    from research.texts import token_ids

    ids = token_ids(tok, "prose", max(a.contexts)).view(1, -1)  # held-out prose
    print(f"model {a.model}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, packed CPU kernel: {packed_cpu.available()}")
    results = []
    for context in a.contexts:
        names = a.caches + (["quanto"] if context in a.quanto else [])
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        r = run_context(model, ids, context, a.steps, names)
        r["uptime"] = load
        results.append(r)
        ms = r["ms_per_step"]
        print(f"\ncontext {context} ({a.steps} steps; {load})")
        for name in names:
            line = f"  {name:9s} {ms[name]:8.1f} ms/step  {1000 / ms[name]:6.1f} tok/s  x{ms['fp'] / ms[name]:.2f} of fp"
            if "quanto" in ms:
                line += f"  x{ms['quanto'] / ms[name]:.2f} of quanto"
            print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
