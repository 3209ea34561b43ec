"""The CPU fast path of packed decode attention, chosen by measurement: inductor vs the C++ kernel.

    python bench/bench_packed_compile.py                       # 1k, 4k, 8k context; int4 and int2; 1 thread
    python bench/bench_packed_compile.py --contexts 4096 --bits 4 --reps 40 --threads 2 --json out.json

One decode step's attention of one layer with SmolLM2-135M's shapes (3 KV heads of 64, 9 query
heads: 3 queries per KV head, float32), the keys quantized per channel and the values per token in
groups of 64 (KIVI, ``tiercache.quantize.blocks``), every context token packed plus the new token
exact. Variants, in one run, interleaved (one call of each in turn, the order rotating, so load
from other processes slows them alike):

- ``cpp``: ``packed_attention.attend`` with the C++ extension (``tiercache.quantize.packed_cpu``);
- ``inductor``: the same math (unpack the centred codes, scale folded into the query, offsets as
  one term, softmax, values weighted by ``p * scale``) as plain torch ops, ``torch.compile``d by
  inductor (``fullgraph``, static shapes; its compile time is reported per shape);
- ``inductor-fused``: the same with the two matmuls over the codes written as broadcast products
  and sums, so inductor can fuse the unpacking into the reductions (no float copy of the codes);
- ``eager``: ``packed_attention.attend`` with the kernel off (the torch reference, what runs where
  the extension is missing);
- ``deq-sdpa``: dequantize every block into a workspace (``BlockCodec.decode``), then
  ``scaled_dot_product_attention`` (the path before packed attention);
- ``fp-sdpa``: SDPA over full-precision K/V (no quantization: the bytes a quantized step saves).

Printed: ms per call (median), each variant's ratio to ``cpp`` (> 1: slower than the kernel), the
largest difference from ``deq-sdpa``'s output, the load average before and after (the machine is
shared), torch's thread count. Compile times are cold (inductor's on-disk graph cache off unless
``--inductor-cache``). No pass / fail: figures for ``docs/packed-attention.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import packed_attention, packed_cpu
from tiercache.quantize.blocks import Codec
from tiercache.quantize.codec import CodecSpec

KV_HEADS, Q_HEADS, HEAD_DIM, GROUP = 3, 9, 64, 64


def _unpack_centred(codes: torch.Tensor, bits: int, shape) -> torch.Tensor:
    """Planar codes ``[B, H, N, bytes]`` -> ``code - mid`` float32 ``[B, H, N, *shape]``."""
    b, h, n, _ = codes.shape
    if bits != 8:
        per = 8 // bits
        shifts = torch.arange(per, device=codes.device, dtype=torch.uint8).mul_(bits).view(per, 1)
        codes = (codes.unsqueeze(-2) >> shifts) & (2**bits - 1)  # [B, H, N, per, bytes]
    return codes.reshape(b, h, n, *shape).float() - (2**bits - 1) / 2


def packed_decode(q, kc, ks, ko, vc, vs, vo, tk, tv, kbits: int, vbits: int):
    """The packed decode attention as torch ops (what inductor compiles): ``q`` ``[B, H, M, D]``
    float32 with the softmax scale in; keys per channel (``ks``, ``ko`` ``[B, H, N, 1, D]``), values
    per token (``vs``, ``vo`` ``[B, H, N, G, 1]``), the exact tail ``tk``, ``tv`` ``[B, H, T, D]``."""
    b, h, m, d = q.shape
    n = kc.shape[2]
    ck = _unpack_centred(kc, kbits, (GROUP, d))  # [B, H, N, G, D]
    ko = ko + (2**kbits - 1) / 2 * ks
    qn = q.unsqueeze(2)  # [B, H, 1, M, D]
    s = torch.matmul(ck, (qn * ks).transpose(-1, -2)) + (qn * ko).sum(-1).unsqueeze(-2)  # [B, H, N, G, M]
    s = torch.cat([s.permute(0, 1, 4, 2, 3).reshape(b, h, m, n * GROUP), q @ tk.transpose(-1, -2)], -1)
    p = torch.softmax(s, -1)  # [B, H, M, N*G + T]
    pb, pt = p[..., : n * GROUP].view(b, h, m, n, GROUP), p[..., n * GROUP :]
    cv = _unpack_centred(vc, vbits, (GROUP, d))  # [B, H, N, G, D]
    vo = vo + (2**vbits - 1) / 2 * vs
    w = pb * vs.squeeze(-1).unsqueeze(2)  # [B, H, M, N, G]
    out = torch.einsum("bhmng,bhngd->bhmd", w, cv)
    out = out + torch.einsum("bhmng,bhng->bhm", pb, vo.squeeze(-1)).unsqueeze(-1)
    return out + pt @ tv  # [B, H, M, D]


def packed_decode_fused(q, kc, ks, ko, vc, vs, vo, tk, tv, kbits: int, vbits: int):
    """``packed_decode`` written as broadcasts and sums, no matmul: inductor can fuse the unpacking
    into the reductions (no float copy of the codes); the same numbers up to summation order."""
    b, h, m, d = q.shape
    n = kc.shape[2]
    ck = _unpack_centred(kc, kbits, (GROUP, d))  # [B, H, N, G, D]
    ko = ko + (2**kbits - 1) / 2 * ks
    qn = q.unsqueeze(2)  # [B, H, 1, M, D]
    qs = (qn * ks).unsqueeze(3)  # [B, H, N, 1, M, D]
    s = (ck.unsqueeze(-2) * qs).sum(-1) + (qn * ko).sum(-1).unsqueeze(-2)  # [B, H, N, G, M]
    s = torch.cat([s.permute(0, 1, 4, 2, 3).reshape(b, h, m, n * GROUP), q @ tk.transpose(-1, -2)], -1)
    p = torch.softmax(s, -1)  # [B, H, M, N*G + T]
    pb, pt = p[..., : n * GROUP].view(b, h, m, n, GROUP), p[..., n * GROUP :]
    cv = _unpack_centred(vc, vbits, (GROUP, d))  # [B, H, N, G, D]
    vo = vo + (2**vbits - 1) / 2 * vs
    w = (pb * vs.squeeze(-1).unsqueeze(2)).permute(0, 1, 3, 4, 2)  # [B, H, N, G, M]
    out = (w.unsqueeze(-1) * cv.unsqueeze(-2)).sum((2, 3))  # [B, H, M, D]
    out = out + (pb * vo.squeeze(-1).unsqueeze(2)).sum((-1, -2)).unsqueeze(-1)
    return out + pt @ tv  # [B, H, M, D]


class Case:
    """One context and bit width: packed rows, the exact new token, a query, and each variant's call."""

    def __init__(self, context: int, bits: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        shape = (1, KV_HEADS, context, HEAD_DIM)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        self.new = (torch.randn(1, KV_HEADS, 1, HEAD_DIM, generator=g), torch.randn(1, KV_HEADS, 1, HEAD_DIM, generator=g))
        self.query = torch.randn(1, Q_HEADS, 1, HEAD_DIM, generator=g)
        spec = CodecSpec.of(QuantizePolicy(bits=bits, group_size=GROUP))
        self.codecs = Codec(spec).for_kv(HEAD_DIM, HEAD_DIM, torch.float32)
        self.rows = (self.codecs[0].encode(k), self.codecs[1].encode(v))  # [B, H, N, row] uint8
        self.bits, self.context = bits, context
        self.packed = packed_attention.Packed(None, self.rows, 0, [self.new], self.codecs)
        self.work = (torch.empty(shape), torch.empty(shape))
        self.full = (torch.cat([k, self.new[0]], 2), torch.cat([v, self.new[1]], 2))
        rep = Q_HEADS // KV_HEADS
        self.q = (self.query * HEAD_DIM**-0.5).reshape(1, KV_HEADS, rep, HEAD_DIM)  # heads grouped as repeat_kv
        parts = [packed_attention._parts(r, c) for r, c in zip(self.rows, self.codecs)]
        (kc, ks, ko), (vc, vs, vo) = parts
        self.inputs = (kc.contiguous(), ks.contiguous(), ko.contiguous(), vc.contiguous(),
                       vs.reshape(*vs.shape[:4], 1).contiguous(), vo.reshape(*vo.shape[:4], 1).contiguous(), *self.new)
        self.compiled = {}

    def cpp(self):
        return packed_attention.attend(self.query, self.packed)

    def eager(self):
        real = packed_cpu.handles
        packed_cpu.handles = lambda *a: False
        try:
            return packed_attention.attend(self.query, self.packed)
        finally:
            packed_cpu.handles = real

    def compile(self) -> dict:
        """Compile both inductor variants for this shape: seconds each took (its first call)."""
        took = {}
        for name, f in (("inductor", packed_decode), ("inductor-fused", packed_decode_fused)):
            fn = torch.compile(f, fullgraph=True, dynamic=False, backend="inductor")
            t0 = time.perf_counter()
            fn(self.q, *self.inputs, self.bits, self.bits)
            self.compiled[name] = fn
            took[name] = time.perf_counter() - t0
        return took

    def _compiled(self, name: str):
        out = self.compiled[name](self.q, *self.inputs, self.bits, self.bits)  # [B, Hkv, rep, D]
        return out.reshape(1, Q_HEADS, 1, HEAD_DIM)

    def inductor(self):
        return self._compiled("inductor")

    def inductor_fused(self):
        return self._compiled("inductor-fused")

    def deq_sdpa(self):
        for rows, codec, out in zip(self.rows, self.codecs, self.work):
            codec.decode(rows, out)
        k, v = torch.cat([self.work[0], self.new[0]], 2), torch.cat([self.work[1], self.new[1]], 2)
        return F.scaled_dot_product_attention(self.query, k, v, enable_gqa=True)

    def fp_sdpa(self):
        return F.scaled_dot_product_attention(self.query, *self.full, enable_gqa=True)


VARIANTS = {"cpp": Case.cpp, "inductor": Case.inductor, "inductor-fused": Case.inductor_fused, "eager": Case.eager, "deq-sdpa": Case.deq_sdpa,
            "fp-sdpa": Case.fp_sdpa}


@torch.no_grad()
def run(context: int, bits: int, reps: int) -> dict:
    case = Case(context, bits)
    compile_s = case.compile()
    names = [n for n in VARIANTS if n != "cpp" or packed_cpu.available()]
    ref = case.deq_sdpa().clone()
    diffs = {n: float((VARIANTS[n](case) - ref).abs().max()) for n in names if n != "fp-sdpa"}
    for name in names:  # warm-up
        VARIANTS[name](case)
    times = {n: [] for n in names}
    for i in range(reps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            VARIANTS[name](case)
            times[name].append(time.perf_counter() - t0)
    ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    return {"context": context, "bits": bits, "ms": ms, "compile_s": compile_s, "max_diff_vs_deq": diffs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--inductor-cache", action="store_true", help="let inductor reuse its on-disk cache (warm compile times)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.inductor_cache:  # compile times from cold: no graph reused from an earlier run's disk cache
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = False
        inductor_config.autotune_local_cache = False
    load0 = os.getloadavg()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}, C++ kernel available: {packed_cpu.available()}, load average {load0}")
    rows = [run(c, b, args.reps) for c in args.contexts for b in args.bits]
    load1 = os.getloadavg()
    names = list(rows[0]["ms"])
    print("| context | bits | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"{n} / cpp" for n in names if n != "cpp") + " | compile s (inductor, fused) |")
    print("|" + "---|" * (2 + 2 * len(names)))
    for r in rows:
        ms = r["ms"]
        ratios = [f"{ms[n] / ms['cpp']:.2f}" if "cpp" in ms else "-" for n in names if n != "cpp"]
        print(f"| {r['context']} | {r['bits']} | " + " | ".join(f"{ms[n]:.3f}" for n in names) + " | "
              + " | ".join(ratios) + f" | {r['compile_s']['inductor']:.1f}, {r['compile_s']['inductor-fused']:.1f} |")
    worst = max(d for r in rows for d in r["max_diff_vs_deq"].values())
    print(f"# largest |out - deq-sdpa| over variants: {worst:.2e}; load average after {load1}")
    result = {"rows": rows, "threads": args.threads, "load_before": load0, "load_after": load1,
              "torch": torch.__version__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
