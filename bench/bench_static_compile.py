"""Decode speed of the compiled static cache (``CompileableCache``) against the dynamic caches.

    python bench/bench_static_compile.py                         # built-in tiny model, 1k and 3k context
    python bench/bench_static_compile.py --contexts 2048 --new 24 --threads 2 --json out.json

Greedy ``generate`` on the built-in trained tiny model (4 layers, 2 KV heads of 64), per context:

- ``dyn-fp`` / ``dyn-int4``: ``TieredCache`` full precision / int4 (packed attention, the C++
  kernel), eager;
- ``static-int4``: ``CompileableCache`` int4 (the same quantize section), eager;
- ``static-int4-compiled`` / ``static-fp-compiled``: ``CompileableCache`` int4 / full precision,
  the decode step compiled by inductor through ``generate``'s ``compile_config`` (one warm-up
  ``generate`` compiles it; its time is reported).

Decode ms per token = (time of ``generate`` with ``new + 1`` tokens - time with 1) / ``new``, the
median over ``--repeats``, the setups interleaved (order rotating) so load from other processes
slows them alike; ratios to ``dyn-int4`` from the same run; the load average before and after (the
machine is shared). The int4 setups' tokens are checked equal. No pass / fail.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import CompileConfig

from tiercache import TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.cache.compileable import CompileableCache
from tiercache.models.load import load_model
from tiercache.models.tiny import eval_ids

Q = {"bits": 4, "group_size": 64, "residual_length": 128}
SETUPS = ["dyn-fp", "dyn-int4", "static-int4", "static-int4-compiled", "static-fp-compiled"]


def make_cache(name: str, config, max_length: int):
    if name == "dyn-fp":
        return TieredCache.from_policy({"name": name}, config)
    if name == "dyn-int4":
        return TieredCache.from_policy({"name": name, "quantize": Q}, config)
    static = {"name": name, "storage": "static", "max_length": max_length}
    return CompileableCache.from_policy({**static, **({} if "fp" in name else {"quantize": Q})}, config)


@torch.no_grad()
def generate(model, ids, name: str, new: int, max_length: int, cc):
    cache = make_cache(name, model.config, max_length)
    kw = {"compile_config": cc} if name.endswith("compiled") else {"disable_compile": True}
    t0 = time.perf_counter()
    out = model.generate(ids, **cache_arg(cache), max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
    return time.perf_counter() - t0, out


def run_context(model, ids, new: int, repeats: int, cc) -> dict:
    max_length = ids.shape[1] + new + 1
    compile_s, tokens = {}, {}
    for name in SETUPS:  # warm-up (the compiled ones compile here: their first decode step)
        took, out = generate(model, ids, name, new + 1, max_length, cc)
        if name.endswith("compiled"):
            compile_s[name] = took
        tokens[name] = out
    times = {name: [] for name in SETUPS}
    for i in range(repeats):
        for name in SETUPS[i % len(SETUPS):] + SETUPS[: i % len(SETUPS)]:
            one, _ = generate(model, ids, name, 1, max_length, cc)
            many, _ = generate(model, ids, name, new + 1, max_length, cc)
            times[name].append((many - one) / new)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    same = all(torch.equal(tokens[n], tokens["dyn-int4"]) for n in ("static-int4", "static-int4-compiled"))
    return {"context": ids.shape[1], "ms_per_token": ms, "compile_s": compile_s, "int4_tokens_equal": same}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 3072])
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model("tiny")
    cc = CompileConfig(fullgraph=True, dynamic=False)
    cc._compile_all_devices = True  # transformers compiles on CPU only when asked
    load0 = os.getloadavg()
    print(f"# tiny model, torch {torch.__version__}, threads {torch.get_num_threads()}, load average {load0}")
    rows = [run_context(model, eval_ids(tok, c)[None], args.new, args.repeats, cc) for c in args.contexts]
    load1 = os.getloadavg()
    print("| context | " + " | ".join(f"{n} ms/token" for n in SETUPS) + " | "
          + " | ".join(f"{n} speed vs dyn-int4" for n in SETUPS if n != "dyn-int4") + " | compile s (int4, fp) | int4 tokens equal |")
    print("|" + "---|" * (2 * len(SETUPS) + 2))
    for r in rows:
        ms = r["ms_per_token"]
        ratios = [f"{ms['dyn-int4'] / ms[n]:.2f}x" for n in SETUPS if n != "dyn-int4"]
        cs = r["compile_s"]
        print(f"| {r['context']} | " + " | ".join(f"{ms[n]:.2f}" for n in SETUPS) + " | " + " | ".join(ratios)
              + f" | {cs['static-int4-compiled']:.1f}, {cs['static-fp-compiled']:.1f} | {r['int4_tokens_equal']} |")
    print(f"# ratios: dyn-int4 ms / setup ms (> 1: the setup decodes faster); load average after {load1}")
    result = {"rows": rows, "threads": args.threads, "load_before": load0, "load_after": load1,
              "torch": torch.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
