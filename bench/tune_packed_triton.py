"""Launch settings of the Triton packed-attention kernel, swept on the GPU at hand.

    python bench/tune_packed_triton.py                    # needs CUDA; 8B-shaped layer, bf16, int4
    python bench/tune_packed_triton.py --contexts 4096,32768 --bits 4,2 --batch 1
    python bench/tune_packed_triton.py --dry-run          # CPU, tiny, Triton interpreter: the script runs

For each context and bit width, one decode step's attention (``packed_triton`` through SDPA, as
``bench_packed_triton.py`` times it) under every combination of: programs per SM (the split count
is chosen so that batch x K/V heads x splits is about this many programs per SM), the fewest
packed blocks a split takes, ``num_warps`` and ``num_stages``. Each row: median ms, the speed-up
over the shipped setting (``packed_triton.LAUNCH`` and ``_default_splits``, timed in the same run),
and the largest difference from that setting's output (a launch setting must not change the
result beyond float32 summation order). A setting that does not fit the GPU (shared memory) is
listed as such. The settings found here are what ``packed_triton`` ships; rerun it on another GPU.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="4096,32768", help="comma-separated token counts")
    p.add_argument("--bits", default="4", help="comma-separated bit widths (2, 4, 8)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--per-sm", default="2,4,8,16", help="programs per SM to try")
    p.add_argument("--min-blocks", default="1,4", help="fewest packed blocks per split to try")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=6, help="rows printed per context, fastest first")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, under the Triton interpreter")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.contexts, args.per_sm, args.min_blocks, args.warps, args.stages = "96", "2,4", "1", "4", "1"
        args.iters, args.repeats = 1, 1
    import torch
    import torch.nn.functional as F

    if not args.dry_run and not torch.cuda.is_available():
        print("tune_packed_triton: no CUDA device; nothing to tune (--dry-run runs it on the CPU)")
        return 0
    from bench.bench_packed_triton import quantized_layer, timed
    from tiercache.quantize import packed_triton

    device = torch.device("cuda" if not args.dry_run else "cpu")
    dtype = torch.bfloat16 if not args.dry_run else torch.float32
    shape = dict(heads=32, kv_heads=8, head_dim=128, group=64, residual=128) if not args.dry_run else \
        dict(heads=4, kv_heads=2, head_dim=32, group=16, residual=16)
    layer_args = argparse.Namespace(group=shape["group"], residual=shape["residual"])
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    shipped = (dict(packed_triton.LAUNCH), packed_triton._default_splits)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}, "
          f"{sms} SMs; batch {args.batch}, {shape['heads']} query heads on {shape['kv_heads']} K/V heads, "
          f"head dim {shape['head_dim']}, {dtype}, groups of {shape['group']}; median of {args.repeats} x {args.iters} calls")
    print(f"shipped: {shipped[0]}, splits by packed_triton._default_splits\n")

    def use(launch, splitter):
        packed_triton.LAUNCH.clear()
        packed_triton.LAUNCH.update(launch)
        packed_triton._default_splits = splitter

    def splitter_for(per_sm: int, min_blocks: int):
        def splits(bh, n_vis, g, dev):
            return max(1, min(-(-per_sm * sms // bh), -(-n_vis // (min_blocks * g))))
        return splits

    failed = 0
    try:
        for n, bits in itertools.product(_ints(args.contexts), _ints(args.bits)):
            g = torch.Generator(device=device).manual_seed(n)

            def rand(*s):
                return torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dtype)

            b, hkv, d = args.batch, shape["kv_heads"], shape["head_dim"]
            k, v, q = rand(b, hkv, n, d), rand(b, hkv, n, d), rand(b, shape["heads"], 1, d)
            lay = quantized_layer(bits, True, layer_args)
            lay.append(k, v)
            pk, pv = lay.append(rand(b, hkv, 1, d), rand(b, hkv, 1, d))

            def attn():
                return F.scaled_dot_product_attention(q, pk, pv, enable_gqa=True)

            use(*shipped)
            ref = attn().float()
            base = timed(attn, args, device)
            rows = []
            for per_sm, mb, w, st in itertools.product(_ints(args.per_sm), _ints(args.min_blocks),
                                                      _ints(args.warps), _ints(args.stages)):
                use({**shipped[0], "num_warps": w, "num_stages": st}, splitter_for(per_sm, mb))
                try:
                    diff = (attn().float() - ref).abs().max().item()
                    ms = timed(attn, args, device)
                except Exception as e:  # a setting the GPU cannot launch (shared memory, registers)
                    rows.append((float("inf"), per_sm, mb, w, st, f"does not run: {type(e).__name__}", None))
                    continue
                rows.append((ms, per_sm, mb, w, st, "", diff))
            rows.sort(key=lambda r: r[0])
            print(f"### context {n}, int{bits}: shipped setting {base:.3f} ms")
            print("| ms | speed-up vs shipped | programs / SM | min blocks / split | warps | stages | max |diff| |")
            print("|---|---|---|---|---|---|---|")
            for ms, per_sm, mb, w, st, note, diff in rows[: args.top] + [r for r in rows if r[5]]:
                if note:
                    print(f"| - | {note} | {per_sm} | {mb} | {w} | {st} | - |")
                else:
                    print(f"| {ms:.3f} | {base / ms:.2f}x | {per_sm} | {mb} | {w} | {st} | {diff:.2e} |")
                    failed |= diff > 2e-2  # a launch setting that changes the answer
            print()
    finally:
        use(*shipped)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
