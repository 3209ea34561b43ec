"""Lifecycle benchmark: save / load seconds, bytes on disk vs ``nbytes()``, retier speed and its
peak extra memory, per policy.

    python bench/bench_lifecycle.py                          # 8 layers x 8 kv heads x 128, 4096 tokens, bf16
    python bench/bench_lifecycle.py --context 32768 --device cuda

Each policy's cache is fed the same random K/V (a prefill of ``--context`` tokens through
``cache.update``: the cache is what is measured, no model). Per policy:
- save s / load s: ``cache.save(path)`` and ``TieredCache.load(path, config)`` (best of
  ``--repeats``), and whether the loaded cache exports exactly what the saved one does;
- file / nbytes: bytes on disk against the bytes the layers hold (``nbytes()`` without the
  shared workspace and mirrors, which are not saved), and the fp16/bf16 history for scale;
- retier: the cache moved to the target policy of the row (``cache.retier``): seconds per GiB
  of full-precision history moved, and the peak extra memory above what the cache holds before
  or after, in layers at full precision (``tiercache.lifecycle.AllocationMeter``, a separate run).
Prints a markdown table and the device; writes ``out/bench_lifecycle.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from tiercache import TieredCache
from tiercache.lifecycle.meter import AllocationMeter

INT4 = {"bits": 4, "group_size": 64, "residual_length": 128}
POLICIES = {
    "fp": {},
    "static": {"storage": "static", "max_length": None},  # max_length set to the context
    "host": {"offload": {"device": "cpu"}},
    "disk": {"offload": {"device": "disk"}},
    "int4": {"quantize": INT4},
    "int4-host": {"quantize": INT4, "offload": {"device": "cpu"}},
    "int4-disk": {"quantize": INT4, "offload": {"device": "disk"}},
    "int2": {"quantize": {**INT4, "bits": 2}},
}
RETIER = {"fp": "int4", "static": "host", "host": "fp", "disk": "host", "int4": "int4-host",
          "int4-host": "fp", "int4-disk": "int4", "int2": "int4"}


def policy(name: str, args) -> dict:
    p = {"name": name, **POLICIES[name]}
    if name == "static":
        p["max_length"] = args.context + 16
    if p.get("offload", {}).get("device") == "disk":
        p["offload"] = {**p["offload"], "path": args.disk_path}
    return p


def filled(name: str, config, args) -> TieredCache:
    cache = TieredCache.from_policy(policy(name, args), config)
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.kv_heads, args.context, args.head_dim)
    dtype = getattr(torch, args.dtype)
    for i in range(args.layers):
        k = torch.randn(shape, generator=g).to(args.device, dtype)
        cache.update(k, torch.randn(shape, generator=g).to(args.device, dtype), i)
    return cache


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def same(a: TieredCache, b: TieredCache) -> bool:
    for x, y in zip(a.layers, b.layers):
        ex, ey = x.export(), y.export()
        if ex[2] != ey[2] or not torch.equal(ex[0], ey[0]) or not torch.equal(ex[1], ey[1]):
            return False
    return True


def row(name: str, config, args, workdir: str) -> dict:
    elt = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    layer_fp = 2 * args.batch * args.kv_heads * args.context * args.head_dim * elt
    cache = filled(name, config, args)
    held = sum(sum(layer.nbytes().values()) for layer in cache.layers)
    path = os.path.join(workdir, f"{name}.safetensors")
    save_s = min(timed(lambda: cache.save(path), args.device)[0] for _ in range(args.repeats))
    loads = [timed(lambda: TieredCache.load(path, config), args.device) for _ in range(args.repeats)]
    load_s, loaded = min(t for t, _ in loads), loads[-1][1]
    exact = same(cache, loaded)
    del loads, loaded
    target = RETIER[name]
    times = []
    for _ in range(args.repeats):
        moved = filled(name, config, args)
        times.append(timed(lambda: moved.retier(policy(target, args)), args.device)[0])
        del moved
    moved = filled(name, config, args)  # peak memory in a run of its own (the meter slows torch calls)
    with AllocationMeter([*moved.state_dict().values(), *moved.shared_buffers()]) as meter:
        moved.retier(policy(target, args))
    extra = meter.peak - max(meter.net, 0)
    history_gib = args.layers * layer_fp / 2**30
    return {"policy": name, "save_s": save_s, "load_s": load_s, "exact": exact,
            "file_bytes": os.path.getsize(path), "nbytes": held, "fp_bytes": args.layers * layer_fp,
            "retier_to": target, "retier_s_per_gib": min(times) / history_gib,
            "retier_peak_extra_bytes": extra, "retier_peak_extra_layers": extra / layer_fp}


def table(rows: list[dict]) -> str:
    out = ["| policy | save s | load s | exact | file MiB | nbytes MiB | file / nbytes | fp MiB | retier to | "
           "retier s/GiB | peak extra (layers fp) |", "|" + "---|" * 11]
    for r in rows:
        out.append(f"| {r['policy']} | {r['save_s']:.3f} | {r['load_s']:.3f} | {r['exact']} | "
                   f"{r['file_bytes'] / 2**20:.2f} | {r['nbytes'] / 2**20:.2f} | {r['file_bytes'] / r['nbytes']:.3f} | "
                   f"{r['fp_bytes'] / 2**20:.1f} | {r['retier_to']} | {r['retier_s_per_gib']:.2f} | "
                   f"{r['retier_peak_extra_layers']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    ap.add_argument("--out", default="out", help="directory for bench_lifecycle.json")
    args = ap.parse_args(argv)
    for flag in ("layers", "kv_heads", "head_dim", "context", "batch", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be a positive int, got {getattr(args, flag)}")
    names = [n for n in args.policies.split(",") if n]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; allowed: {', '.join(POLICIES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    config = LlamaConfig(num_hidden_layers=args.layers, num_attention_heads=args.kv_heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, hidden_size=args.kv_heads * args.head_dim, vocab_size=16)
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-") as workdir:
        args.disk_path = os.path.join(workdir, "tier")
        rows = [row(name, config, args, workdir) for name in names]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"\n## Cache lifecycle: {args.layers} layers x {args.kv_heads} kv heads x {args.head_dim}, "
          f"{args.context} tokens, batch {args.batch}, {args.dtype}, on {args.device} ({device}, torch {torch.__version__})\n")
    print(table(rows))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "bench_lifecycle.json"
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "disk_path"}, "device": device,
                               "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
