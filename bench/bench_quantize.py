"""Quantize processor vs transformers' QuantizedCache (quanto backend) on a tiny random Llama.

    python bench/bench_quantize.py                      # 3k-token prompt, 512 new tokens
    python bench/bench_quantize.py --prompt 512 --new 64 --json out.json

Every cache decodes the *same* tokens (the full-precision run's greedy choices) so logits and
attention outputs line up step by step; the caches decode in lockstep (one step each in turn)
so that load from other processes slows them alike. Reported, per cache: decode tokens/s (and the ratio to
QuantizedCache), cache bytes (end of run, and mean over decode steps), relative L2 error of the
logits and of every layer's attention output versus full precision, and top-1 agreement. A
second table shows per-channel vs per-token key quantization: in the model, and on synthetic
keys with a few large-magnitude channels (as real LLM keys have). Quanto's C++ extension is
built and warmed up before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, QuantizedCache

from tiercache import TieredCache


def tiny_llama(positions: int) -> LlamaForCausalLM:
    """The project's tiny Llama architecture (hidden 192, 4 layers, 2 KV heads of 64), random weights."""
    config = LlamaConfig(vocab_size=259, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=max(4096, positions), attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def tensor_bytes(t) -> int:
    """Bytes behind a tensor, looking inside quanto's tensor subclasses (codes, scale, shift)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def cache_bytes(cache) -> int:
    if isinstance(cache, TieredCache):
        return sum(cache.nbytes().values())
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total


class AttentionTap:
    """Records every layer's attention output, per decode step."""

    def __init__(self, model):
        self.out: list[torch.Tensor] = []
        self.handles = [layer.self_attn.register_forward_hook(self._hook) for layer in model.model.layers]

    def _hook(self, module, args, output):
        self.out.append(output[0].detach().clone())

    def close(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def run(model, caches: dict, prompt: torch.Tensor, new: int) -> dict:
    """Prefill each cache, then decode ``new`` steps in lockstep (one step of each cache in turn,
    so load from other processes hits all alike). The first cache is the reference: it picks
    the greedy tokens that every cache is fed. Returns one record per cache."""
    taps = AttentionTap(model)
    recs = {}
    for name, cache in caches.items():
        logits = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:]
        recs[name] = {"cache": cache, "time": 0.0, "sizes": [], "logits": [], "attn": [], "first": logits}
    taps.out.clear()
    nxt = next(iter(recs.values()))["first"].argmax(-1)
    for i in range(new):
        for j, (name, r) in enumerate(recs.items()):
            start = time.perf_counter()
            logits = model(nxt, past_key_values=r["cache"], use_cache=True).logits[:, -1:]
            r["time"] += time.perf_counter() - start
            r["logits"].append(logits)
            r["attn"].append(torch.stack(taps.out).flatten(1))  # [layers, hidden]
            taps.out.clear()
            if i % 32 == 0:
                r["sizes"].append(cache_bytes(r["cache"]))
            if j == 0:
                ref_next = logits.argmax(-1)
        nxt = ref_next
    taps.close()
    return {name: {"tokens/s": new / r["time"], "bytes": cache_bytes(r["cache"]),
                   "mean_bytes": sum(r["sizes"]) / len(r["sizes"]), "logits": torch.cat(r["logits"], 1),
                   "attn": torch.stack(r["attn"])} for name, r in recs.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def ours(bits, group, residual, key_axis="channel", backend="native"):
    return {"name": "ours", "quantize": {"backend": backend, "bits": bits, "group_size": group,
                                          "residual_length": residual, "key_axis": key_axis, "value_axis": "token"}}


def outlier_key_error(bits: int, group: int) -> dict:
    """Attention-output error with per-channel vs per-token keys on keys with outlier channels."""
    from tiercache.policy import QuantizePolicy
    from tiercache.processors import backends
    from tiercache.processors.blocks import BlockCodec

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 1024, 64, generator=g)
    k[..., [3, 17, 40]] = k[..., [3, 17, 40]] * 0.3 + torch.tensor([20.0, -15.0, 12.0])
    q, v = torch.randn(1, 2, 32, 64, generator=g), torch.randn(1, 2, 1024, 64, generator=g)
    attn = lambda kk: torch.softmax(q @ kk.transpose(-1, -2) / 8, -1) @ v  # noqa: E731
    backend = backends.get(QuantizePolicy(bits=bits, group_size=group))
    return {axis: rel(attn(BlockCodec(backend, group, 64, axis, torch.float32).roundtrip(k)), attn(k))
            for axis in ("channel", "token")}


def warm_up(model, group, residual, bits):
    """Build quanto's extension and run both quantized caches briefly, outside any timing."""
    ids = torch.randint(0, 256, (1, 2 * residual))
    run(model, {"theirs": QuantizedCache("quanto", model.config, nbits=bits, q_group_size=group, residual_length=residual),
                "ours": TieredCache.from_policy(ours(bits, group, residual), model.config)}, ids, 8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = tiny_llama(args.prompt + args.new)
    prompt = torch.randint(0, 256, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    warm_up(model, args.group, args.residual, args.bits)

    caches = {
        "full precision (DynamicCache)": DynamicCache(config=model.config),
        "transformers QuantizedCache (quanto)": QuantizedCache(
            "quanto", model.config, nbits=args.bits, q_group_size=args.group, residual_length=args.residual),
        "tiercache Quantize (native, KIVI)": TieredCache.from_policy(ours(args.bits, args.group, args.residual), model.config),
        "tiercache Quantize (quanto, KIVI)": TieredCache.from_policy(
            ours(args.bits, args.group, args.residual, backend="quanto"), model.config),
        "tiercache Quantize (native, per-token keys)": TieredCache.from_policy(
            ours(args.bits, args.group, args.residual, key_axis="token"), model.config),
    }
    rows = run(model, caches, prompt, args.new)
    ref = rows["full precision (DynamicCache)"]
    base = rows["transformers QuantizedCache (quanto)"]
    device = f"CPU ({platform.processor() or platform.machine()}), {args.threads} threads, torch {torch.__version__}"
    print(f"\n## Quantized KV cache: int{args.bits}, group {args.group}, residual {args.residual}, "
          f"prompt {args.prompt}, {args.new} new tokens\n\ndevice: {device}; tiny random Llama (4 layers, 2 KV heads x 64), fp32\n")
    print("| cache | tokens/s | vs QuantizedCache | cache bytes (end) | mean bytes | logits rel. err | attn-out rel. err | top-1 agree |")
    print("|---|---|---|---|---|---|---|---|")
    figures = {"device": device, "args": vars(args), "rows": {}}
    for name, r in rows.items():
        f = {"tokens_per_s": r["tokens/s"], "speedup": r["tokens/s"] / base["tokens/s"], "bytes": r["bytes"],
             "mean_bytes": r["mean_bytes"], "logits_err": rel(r["logits"], ref["logits"]),
             "attn_err": rel(r["attn"], ref["attn"]),
             "top1": float((r["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean())}
        figures["rows"][name] = f
        print(f"| {name} | {f['tokens_per_s']:.1f} | {f['speedup']:.2f}x | {f['bytes'] / 2**20:.2f} MiB | "
              f"{f['mean_bytes'] / 2**20:.2f} MiB | {f['logits_err']:.2e} | {f['attn_err']:.2e} | {f['top1']:.3f} |")
    synthetic = outlier_key_error(args.bits, args.group)
    chan, tok = figures["rows"]["tiercache Quantize (native, KIVI)"], figures["rows"]["tiercache Quantize (native, per-token keys)"]
    print("\n| key quantization | attn-out rel. err (model) | attn-out rel. err (keys with outlier channels) |")
    print("|---|---|---|")
    print(f"| per-channel (KIVI) | {chan['attn_err']:.2e} | {synthetic['channel']:.2e} |")
    print(f"| per-token | {tok['attn_err']:.2e} | {synthetic['token']:.2e} |")
    figures["outlier_keys"] = synthetic
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
