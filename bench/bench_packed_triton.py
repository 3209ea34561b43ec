"""The Triton packed-attention kernel on a GPU: one attention layer's decode step, 1k to 32k tokens.

    python bench/bench_packed_triton.py                      # needs CUDA; 8B-shaped layer, bf16
    python bench/bench_packed_triton.py --contexts 4096,32768 --iters 200 --json out/triton.json
    python bench/bench_packed_triton.py --dry-run            # CPU, tiny, Triton interpreter: the script runs

One attention layer shaped like an 8B model's (batch 1, 32 query heads on 8 K/V heads, head dim
128, ``--dtype`` bf16), at each context, in one run:

- ``DynamicCache``: transformers' full-precision cache (``update`` per token, ``torch.cat``) and SDPA;
- ``int4`` / ``int2``: a tiercache ``Quantize`` layer (native, KIVI: keys per channel, values per
  token, groups of 64, residual 128) whose decode steps run ``packed_triton`` (no dequantized K/V);
- ``int4-deq``: the same int4 layer with ``packed_attention: false`` (dequantize into a workspace,
  then SDPA: the reference path).

Two figures per cache, median over ``--repeats`` runs of ``--iters`` calls each (CUDA-synchronized):
``attn``: the attention alone on one fixed step (for ``int4-deq``: the dequantization plus
SDPA, as that path does per step), and ``step``: the layer update plus the attention, as a
decode step costs. Ratios are to ``DynamicCache`` and to ``int4-deq``, from the same run; the
largest difference of the Triton output from dequantize-then-SDPA is printed as a check. Without
CUDA it says so and exits 0 (``--dry-run`` instead runs tiny shapes on the CPU under
``TRITON_INTERPRET=1``: the figures then mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="1024,4096,8192,32768", help="comma-separated token counts")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--residual", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=100, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs (the median is reported)")
    p.add_argument("--json", default=None, help="write the rows here too")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, under the Triton interpreter")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (below)
        args.contexts, args.batch, args.heads, args.kv_heads, args.head_dim = "64,96", 1, 4, 2, 32
        args.group, args.residual, args.dtype, args.iters, args.repeats = 16, 16, "float32", 1, 1
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench_packed_triton: needs a CUDA GPU (none visible to torch); nothing measured. "
              "--dry-run runs the script on the CPU under the Triton interpreter.")
        return 0
    from tiercache.quantize import packed_attention, packed_triton

    if not packed_triton.available():
        print("bench_packed_triton: triton is not installed (pip install -e '.[triton]'); nothing measured.")
        return 0
    if args.dry_run:  # CPU tensors: select the Triton kernel as _fast does on CUDA
        packed_attention._fast = lambda device=None: packed_triton
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = getattr(torch, args.dtype)
    rows = [run_context(int(n), args, device, dtype) for n in args.contexts.split(",")]
    print(table(rows, args, device))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": describe(device), "args": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def describe(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"


def quantized_layer(bits: int, packed: bool, args):
    from tiercache.cache.chain import Shared, build
    from tiercache.planner.chainspec import spec_for
    from tiercache.policy.schema import LayerPolicy, QuantizePolicy

    q = QuantizePolicy(bits=bits, group_size=args.group, residual_length=args.residual, packed_attention=packed)
    return build(spec_for(LayerPolicy(0, "full_attention", "full", None, None, q, None)), Shared())


def timed(fn, args, device) -> float:
    """Median ms per call over ``args.repeats`` runs of ``args.iters`` calls."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up (Triton compiles on its first launch)
    sync()
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync()
        runs.append((time.perf_counter() - start) * 1e3 / args.iters)
    return statistics.median(runs)


def run_context(n: int, args, device, dtype) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    from tiercache.quantize import packed_triton

    g = torch.Generator(device=device).manual_seed(n)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    k, v = rand(b, hkv, n, d), rand(b, hkv, n, d)  # [B, Hkv, n, D]: the context
    k1, v1, q = rand(b, hkv, 1, d), rand(b, hkv, 1, d), rand(b, h, 1, d)  # one decode step
    row = {"context": n}

    dyn = DynamicCache()
    dyn.update(k, v, 0)
    fk, fv = dyn.update(k1, v1, 0)

    def dyn_step():
        kk, vv = dyn.update(k1, v1, 0)
        F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    row["DynamicCache"] = {"attn": timed(lambda: F.scaled_dot_product_attention(q, fk, fv, enable_gqa=True), args, device),
                           "step": timed(dyn_step, args, device), "bytes": 2 * k.numel() * k.element_size()}
    for name, bits, packed in (("int4", 4, True), ("int2", 2, True), ("int4-deq", 4, False)):
        lay = quantized_layer(bits, packed, args)
        lay.append(k, v)
        pk, pv = lay.append(k1, v1)
        entry = {}
        if packed:
            parts = pk.pair.packed
            assert packed_triton.handles(parts.codecs[0], parts.blocks[0], "keys"), "the Triton kernel declined"
            entry["attn"] = timed(lambda: F.scaled_dot_product_attention(q, pk, pv, enable_gqa=True), args, device)
            entry["bytes"] = sum(r.numel() for r in parts.blocks)  # the packed rows a step reads
            got = F.scaled_dot_product_attention(q.float(), pk, pv, enable_gqa=True)
            want = F.scaled_dot_product_attention(q.float(), pk.plain().float(), pv.plain().float(), enable_gqa=True)
            entry["max_diff"] = (got.float() - want).abs().max().item()
            if name == "int4":  # this very step dequantized into the workspace, then SDPA (the reference path)
                deq = pk.pair._materialize
                row["int4-deq-attn"] = timed(lambda: F.scaled_dot_product_attention(q, *deq(), enable_gqa=True),
                                             args, device)
        else:
            entry["attn"] = row["int4-deq-attn"]
        entry["step"] = timed(lambda: F.scaled_dot_product_attention(q, *lay.append(k1, v1), enable_gqa=True),
                              args, device)
        row[name] = entry
    return row


CACHES = ("DynamicCache", "int4", "int2", "int4-deq")


def table(rows, args, device) -> str:
    lines = [f"device: {describe(device)}; batch {args.batch}, {args.heads} query heads on {args.kv_heads} K/V heads, "
             f"head dim {args.head_dim}, {args.dtype}, groups of {args.group}, residual {args.residual}; "
             f"median of {args.repeats} x {args.iters} calls",
             "",
             "| context | what | " + " | ".join(f"{c} ms" for c in CACHES)
             + " | int4 / DynamicCache | int4 / int4-deq | int2 / DynamicCache |",
             "|---|---|" + "---|" * (len(CACHES) + 3)]
    for r in rows:
        for what in ("attn", "step"):
            ms = [r[c][what] for c in CACHES]
            speed = [f"{r['DynamicCache'][what] / r['int4'][what]:.2f}x", f"{r['int4-deq'][what] / r['int4'][what]:.2f}x",
                     f"{r['DynamicCache'][what] / r['int2'][what]:.2f}x"]
            lines.append(f"| {r['context']} | {what} | " + " | ".join(f"{x:.3f}" for x in ms) + " | "
                         + " | ".join(speed) + " |")
    peak = peak_gbs(device)
    lines += ["", "effective bandwidth of the attention alone (K/V bytes read / attn time)"
              + (f", and its share of the card's peak {peak:.0f} GB/s" if peak else "") + ": "
              + "; ".join(f"{r['context']}: " + ", ".join(
                  f"{c} {_gbs(r[c]['bytes'], r[c]['attn']):.0f} GB/s"
                  + (f" ({_gbs(r[c]['bytes'], r[c]['attn']) / peak:.0%})" if peak else "")
                  for c in ("DynamicCache", "int4", "int2")) for r in rows)]
    lines += ["", "ratios: speed-ups (> 1: the packed cache is faster); bytes read per step (K/V): "
              + "; ".join(f"{r['context']}: DynamicCache {r['DynamicCache']['bytes']:,}, int4 {r['int4']['bytes']:,}, "
                          f"int2 {r['int2']['bytes']:,}" for r in rows),
              "largest |Triton - dequantize-then-SDPA| (float32 query): "
              + "; ".join(f"{r['context']}: int4 {r['int4']['max_diff']:.2e}, int2 {r['int2']['max_diff']:.2e}"
                          for r in rows)]
    return "\n".join(lines)


def _gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def peak_gbs(device) -> float | None:
    """The card's peak DRAM bandwidth (GB/s) from its memory clock and bus width, when torch says."""
    import torch

    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock * 1e3 * bus / 8 / 1e9 if clock and bus else None  # double data rate


if __name__ == "__main__":
    sys.exit(main())
