"""Offload benchmark: decode speed, peak device memory and bus traffic of offloaded KV caches.

    python bench/bench_offload.py                                   # small CPU default (~1 min)
    python bench/bench_offload.py --device cuda --layers 32 --kv-heads 8 --head-dim 128 \\
        --hidden 1024 --context 32768 --new 64                      # fp16 cache of 4 GiB on a GPU

Caches, on a random Llama whose KV shape is set by the flags (weights kept small on purpose,
the cache is what is measured), all fed the same tokens:
    (a) resident      TieredCache, full precision, on the device
    (b) hf-offload    transformers DynamicCache(offloading=True)        (needs CUDA)
    (c) offload       TieredCache, offload: cpu, prefetch 1
    (d) offload+int4  TieredCache, native int4 (group 64, residual 128) + offload: cpu
Reported: decode tokens/s (and the ratio to (b), else to (a)), peak device memory during
decode, cache bytes per place at the end, and bytes over the bus per decoded token: measured by
``TieredCache.offload_stats()`` for (c) and (d), computed from the layer sizes for (b) (each step
moves every offloaded layer to the device and back). Prints a markdown table and the device;
``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tiercache import TieredCache
from tiercache.cache.compat import cache_arg

OFFLOAD = {"device": "cpu", "prefetch": 1, "pin_memory": True}
INT4 = {"backend": "native", "bits": 4, "group_size": 64, "residual_length": 128}
CACHES = {
    "resident": lambda cfg: TieredCache.from_policy({"name": "resident"}, cfg),
    "hf-offload": lambda cfg: DynamicCache(config=cfg, offloading=True),
    "offload": lambda cfg: TieredCache.from_policy({"name": "offload", "offload": OFFLOAD}, cfg),
    "offload+int4": lambda cfg: TieredCache.from_policy({"name": "offload-int4", "quantize": INT4, "offload": OFFLOAD}, cfg),
}


def build_model(args) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.kv_heads * 2,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         max_position_embeddings=args.context + args.new + 16, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(args.device, getattr(torch, args.dtype))


def bus_bytes(cache: TieredCache) -> int:
    """Bytes the offloaded layers moved over the bus so far, both ways (``offload_stats``)."""
    stats = cache.offload_stats()
    return stats["bytes_h2d"] + stats["bytes_d2h"]


def fp_cache_bytes(args, tokens: int) -> int:
    """Bytes of a full-precision K/V cache of ``tokens`` tokens for this model."""
    elt = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    return 2 * args.layers * args.kv_heads * args.head_dim * tokens * elt


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def measure(name: str, model, args, ids: torch.Tensor) -> dict:
    cache = CACHES[name](model.config)
    model(ids[:, : args.context], **cache_arg(cache), use_cache=True)  # prefill
    pos = args.context
    for _ in range(args.warmup):
        model(ids[:, pos : pos + 1], **cache_arg(cache), use_cache=True)
        pos += 1
    offloaded = isinstance(cache, TieredCache) and cache.offload_stats()["fetches"] > 0  # (prefill fetched)
    moved0 = bus_bytes(cache) if offloaded else 0
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    sync(args.device)
    start = time.perf_counter()
    for _ in range(args.new):
        model(ids[:, pos : pos + 1], **cache_arg(cache), use_cache=True)
        pos += 1
    sync(args.device)
    seconds = time.perf_counter() - start
    row = {"cache": name, "tokens_per_s": args.new / seconds}
    row["peak_device_bytes"] = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None
    if offloaded:
        row["bus_bytes_per_token"] = (bus_bytes(cache) - moved0) / args.new
        row["bus"] = "measured"
    elif name == "hf-offload":
        mid = fp_cache_bytes(args, pos - args.new // 2)  # whole layers, device and back, each step
        row["bus_bytes_per_token"], row["bus"] = 2 * mid, "analytic"
    else:
        row["bus_bytes_per_token"], row["bus"] = 0, "-"
    row["cache_bytes"] = cache.nbytes() if isinstance(cache, TieredCache) else {args.device: fp_cache_bytes(args, pos)}
    if isinstance(cache, TieredCache):
        cache.close()
    del cache
    return row


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def table(rows: list[dict], base: str) -> str:
    ref = next((r for r in rows if r["cache"] == base and "error" not in r), None)
    lines = ["| cache | tokens/s | vs " + base + " | peak device memory | bus bytes/token | cache bytes |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            bus = f"{r['bus_bytes_per_token'] / 2**20:.2f} MiB (analytic)" if "bus_bytes_per_token" in r else ""
            lines.append(f"| {r['cache']} | skipped: {r['error']} | | | {bus} | |")
            continue
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        bus = f"{r['bus_bytes_per_token'] / 2**20:.2f} MiB ({r['bus']})"
        held = ", ".join(f"{k}: {gib(v)}" for k, v in sorted(r["cache_bytes"].items()))
        lines.append(f"| {r['cache']} | {r['tokens_per_s']:.1f} | {ratio} | {gib(r['peak_device_bytes'])} | {bus} | {held} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float16 on CUDA, float32 on CPU by default")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens before decoding")
    p.add_argument("--new", type=int, default=32, help="decoded tokens timed")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--caches", default=",".join(CACHES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")

    model = build_model(args)
    ids = torch.randint(3, 1024, (1, args.context + args.warmup + args.new), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    rows = []
    for name in args.caches.split(","):
        try:
            rows.append(measure(name, model, args, ids))
        except Exception as e:  # a cache that cannot run here (no CUDA, backend missing) is reported, not fatal
            rows.append({"cache": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"})
            if name == "hf-offload":  # its bus traffic follows from the layer sizes all the same
                tokens = args.context + args.warmup + args.new // 2
                rows[-1]["bus_bytes_per_token"] = 2 * fp_cache_bytes(args, tokens)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    print(f"device: {gpu or 'CPU only (' + platform.machine() + '): no GPU present, so the host is the device'}; "
          f"torch {torch.__version__}")
    print(f"model: {args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, {args.dtype}; context "
          f"{args.context}, {args.new} decoded tokens; full-precision cache {gib(fp_cache_bytes(args, args.context))}\n")
    base = "hf-offload" if any(r["cache"] == "hf-offload" and "error" not in r for r in rows) else "resident"
    print(table(rows, base))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": gpu or "cpu", "args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
