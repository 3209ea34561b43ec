"""Quantize processor vs transformers' QuantizedCache (quanto backend) on the built-in tiny Llama.

    python bench/bench_quantize.py                      # 3k-token prompt, 512 new tokens, 1 thread
    python bench/bench_quantize.py --prompt 512 --new 64 --json out.json

The model is the project's trained byte-level tiny Llama (``tiercache.models.tiny``: 4 layers,
2 KV heads x 64, fp32), the same for every cache; the prompt is held-out text. Every cache
decodes the *same* tokens (the full-precision run's greedy choices) so logits and attention
outputs line up step by step; the caches decode in lockstep (one step each in turn, the order
rotating every step) so that load from other processes slows them alike. Reported, per cache: decode tokens/s (and the
ratio to QuantizedCache); bytes held at the end and their mean over the decode steps (every
step sampled), split into the cache's state and tiercache's shared dequantization workspace
(transformers allocates its dequantized K/V afresh each step instead of holding it); relative
L2 error of the logits and of every layer's attention output versus full precision; top-1
agreement. Then a per-component timing of one decode step (an instrumented second pass, kept
out of the tokens/s figures): model compute vs cache update, and inside the update
dequantization, quantization (ours: new blocks; theirs: re-quantizing the whole history at
each flush) and the rest (concatenation, copies, bookkeeping). Last, per-channel vs per-token
key quantization: in the model, and on synthetic keys with a few large-magnitude channels
(as real LLM keys have). Quanto's C++ extension is built and warmed up before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from contextlib import contextmanager

import torch
from transformers import DynamicCache, QuantizedCache

from tiercache import TieredCache
from tiercache.models.tiny import eval_ids
from tiercache.models.load import load_model
from tiercache.cache.compat import cache_arg

FP, THEIRS, OURS = "full precision (DynamicCache)", "transformers QuantizedCache (quanto)", "tiercache Quantize (native, KIVI)"
OURS_QUANTO, OURS_TOKEN = "tiercache Quantize (quanto, KIVI)", "tiercache Quantize (native, per-token keys)"


def tensor_bytes(t) -> int:
    """Bytes behind a tensor, looking inside quanto's tensor subclasses (codes, scale, shift)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def cache_bytes(cache) -> tuple[int, int]:
    """(state bytes, workspace bytes) held by a cache now."""
    if isinstance(cache, TieredCache):
        state = sum(sum(layer.nbytes().values()) for layer in cache.layers)
        return state, sum(cache.workspace_nbytes().values())
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total, 0


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
    the order rotating every step, so load from other processes and what the previous cache
    left in the CPU caches hit all alike). The first cache is the reference: it picks the
    greedy tokens that every cache is fed. Returns one record per cache."""
    taps = AttentionTap(model)
    recs = {}
    for name, cache in caches.items():
        logits = model(prompt, **cache_arg(cache), use_cache=True).logits[:, -1:]
        recs[name] = {"cache": cache, "time": 0.0, "sizes": [], "logits": [], "attn": [], "first": logits}
    taps.out.clear()
    names = list(recs)
    nxt = recs[names[0]]["first"].argmax(-1)
    for i in range(new):
        for name in names[i % len(names):] + names[: i % len(names)]:  # the order rotates every step
            r = recs[name]
            start = time.perf_counter()
            logits = model(nxt, **cache_arg(r["cache"]), use_cache=True).logits[:, -1:]
            r["time"] += time.perf_counter() - start
            r["logits"].append(logits)
            r["attn"].append(torch.stack(taps.out).flatten(1))  # [layers, hidden]
            taps.out.clear()
            r["sizes"].append(cache_bytes(r["cache"]))
        nxt = recs[names[0]]["logits"][-1].argmax(-1)
    taps.close()
    out = {}
    for name, r in recs.items():
        state, work = zip(*r["sizes"])
        out[name] = {"tokens/s": new / r["time"], "bytes": state[-1], "workspace": work[-1],
                     "mean_bytes": sum(state) / len(state), "mean_workspace": sum(work) / len(work),
                     "logits": torch.cat(r["logits"], 1), "attn": torch.stack(r["attn"])}
    return out


# -- per-component timing --------------------------------------------------------------------------

class Clock:
    """Accumulates wall time per component while patched methods run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, method: str, component: str):
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[component] = self.seconds.get(component, 0.0) + time.perf_counter() - start

        setattr(owner, method, timed)
        return lambda: setattr(owner, method, original)


@contextmanager
def instrumented(clock: Clock, kind: str):
    from transformers.cache_utils import QuantoQuantizedLayer

    from tiercache.quantize.blocks import BlockCodec

    if kind == "ours":
        patches = [(TieredCache, "update", "cache update"), (BlockCodec, "decode", "dequantize"),
                   (BlockCodec, "encode", "quantize")]
    else:
        patches = [(QuantizedCache, "update", "cache update"), (QuantoQuantizedLayer, "_dequantize", "dequantize"),
                   (QuantoQuantizedLayer, "_quantize", "quantize")]
    undo = [clock.wrap(*p) for p in patches]
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


@torch.no_grad()
def components(model, makers: dict, prompt: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Milliseconds per decode step for each ``name -> (make_cache, "ours" | "theirs")``: total,
    model (everything but the cache update), the cache update and inside it dequantize /
    quantize / the rest. The caches decode in lockstep, the order rotating, as in ``run``."""
    caches = {name: make() for name, (make, _) in makers.items()}
    for cache in caches.values():
        model(prompt, **cache_arg(cache), use_cache=True)
    clocks = {name: Clock() for name in makers}
    totals = dict.fromkeys(makers, 0.0)
    names = list(makers)
    for i in range(tokens.shape[1]):
        for name in names[i % len(names):] + names[: i % len(names)]:
            with instrumented(clocks[name], makers[name][1]):
                start = time.perf_counter()
                model(tokens[:, i : i + 1], **cache_arg(caches[name]), use_cache=True)
                totals[name] += time.perf_counter() - start
    out = {}
    for name in names:
        ms = {k: 1e3 * v / tokens.shape[1] for k, v in clocks[name].seconds.items()}
        step, update = 1e3 * totals[name] / tokens.shape[1], ms.get("cache update", 0.0)
        out[name] = {"step": step, "model": step - update, "update": update, "dequantize": ms.get("dequantize", 0.0),
                     "quantize": ms.get("quantize", 0.0),
                     "rest": update - ms.get("dequantize", 0.0) - ms.get("quantize", 0.0)}
    return out


# -- figures ---------------------------------------------------------------------------------------

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def ours(bits, group, residual, key_axis="channel", backend="native"):
    return {"name": "ours", "quantize": {"backend": backend, "bits": bits, "group_size": group,
                                          "residual_length": residual, "key_axis": key_axis, "value_axis": "token"}}


def outlier_key_error(bits: int, group: int) -> dict:
    """Attention-output error with per-channel vs per-token keys on keys with outlier channels."""
    from tiercache.policy.schema import QuantizePolicy
    from tiercache.quantize import backends
    from tiercache.quantize.blocks import BlockCodec

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


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="tiny", help="tiny (trained, default) | tiny-random | a path or hub id")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    prompt = eval_ids(tokenizer, args.prompt)[None]  # [1, P] held-out text
    warm_up(model, args.group, args.residual, args.bits)

    theirs = lambda: QuantizedCache(  # noqa: E731
        "quanto", model.config, nbits=args.bits, q_group_size=args.group, residual_length=args.residual)
    mine = lambda: TieredCache.from_policy(ours(args.bits, args.group, args.residual), model.config)  # noqa: E731
    caches = {
        FP: DynamicCache(config=model.config),
        THEIRS: theirs(),
        OURS: mine(),
        OURS_QUANTO: TieredCache.from_policy(ours(args.bits, args.group, args.residual, backend="quanto"), model.config),
        OURS_TOKEN: TieredCache.from_policy(ours(args.bits, args.group, args.residual, key_axis="token"), model.config),
    }
    rows = run(model, caches, prompt, args.new)
    ref, base = rows[FP], rows[THEIRS]
    device = f"CPU ({platform.processor() or platform.machine()}), {args.threads} thread(s), torch {torch.__version__}"
    print(f"\n## Quantized KV cache: int{args.bits}, group {args.group}, residual {args.residual}, "
          f"prompt {args.prompt}, {args.new} new tokens\n\ndevice: {device}; model: {args.model} "
          f"({model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} KV heads x "
          f"{model.config.head_dim}), fp32\n")
    print("| cache | tokens/s | vs QuantizedCache | state bytes (end) | state bytes (mean) | + workspace (end) "
          "| logits rel. err | attn-out rel. err | top-1 agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    figures = {"device": device, "args": vars(args), "rows": {}}
    for name, r in rows.items():
        f = {"tokens_per_s": r["tokens/s"], "speedup": r["tokens/s"] / base["tokens/s"], "bytes": r["bytes"],
             "mean_bytes": r["mean_bytes"], "workspace": r["workspace"], "mean_workspace": r["mean_workspace"],
             "logits_err": rel(r["logits"], ref["logits"]), "attn_err": rel(r["attn"], ref["attn"]),
             "top1": float((r["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean())}
        figures["rows"][name] = f
        print(f"| {name} | {f['tokens_per_s']:.1f} | {f['speedup']:.2f}x | {mib(f['bytes'])} | {mib(f['mean_bytes'])} | "
              f"{mib(f['workspace'])} | {f['logits_err']:.2e} | {f['attn_err']:.2e} | {f['top1']:.3f} |")

    tokens = rows[FP]["logits"].argmax(-1)  # [1, new]: greedy tokens, the same for both caches
    parts = components(model, {THEIRS: (theirs, "theirs"), OURS: (mine, "ours")}, prompt, tokens)
    figures["components_ms_per_step"] = parts
    print("\nper decode step (ms; instrumented pass):\n")
    print("| cache | step | model compute | cache update | of which dequantize | quantize | rest |")
    print("|---|---|---|---|---|---|---|")
    for name, p in parts.items():
        print(f"| {name} | {p['step']:.2f} | {p['model']:.2f} | {p['update']:.2f} | {p['dequantize']:.2f} | "
              f"{p['quantize']:.2f} | {p['rest']:.2f} |")

    synthetic = outlier_key_error(args.bits, args.group)
    chan, tok = figures["rows"][OURS], figures["rows"][OURS_TOKEN]
    print("\n| key quantization | attn-out rel. err (model) | logits rel. err (model) | attn-out rel. err (keys with outlier channels) |")
    print("|---|---|---|---|")
    print(f"| per-channel (KIVI) | {chan['attn_err']:.2e} | {chan['logits_err']:.2e} | {synthetic['channel']:.2e} |")
    print(f"| per-token | {tok['attn_err']:.2e} | {tok['logits_err']:.2e} | {synthetic['token']:.2e} |")
    figures["outlier_keys"] = synthetic
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
