"""Explore KV quantization schemes cheaply, before building one: fake quantization, one forward.

    python bench/explore_kv_schemes.py --texts-per-kind 8                      # every scheme below
    python bench/explore_kv_schemes.py --schemes "int2 +sinks,K4V2 +sinks" --split train

Not the cache: a research aid whose figures only decide what is worth building (the README's
numbers for built policies come from ``bench_real.py``, through the real cache). Each text's
``--prompt`` tokens are prefilled exactly; every layer's prompt K/V are then quantized and
dequantized in place (``fake``, torch ops, any width 1-8 bits, groups of 64: keys per channel
over 64 tokens, values per token) except the first ``sinks`` tokens; the ``--tokens``
continuation is scored in one forward over that past (it attends over itself exactly, as the
residual would). With residual 128, group 64, a prompt of a multiple of 128 and no sinks this is
exactly what the cache's teacher-forced decode computes (the prompt all packed, the continuation
all residual): ``int2`` here gives bench_real.py's +47.99% / +58.17% on the 16 held-out texts.
With sinks it is a close proxy (the cache keeps the last 124 prompt tokens exact).

Schemes (``SCHEMES``) vary the bits per tensor and layer (``key_bits`` / ``value_bits``, a
``policy`` file's overrides), the range (min/max or a least-squared-error search), outliers kept
exact, a Hadamard rotation of the values and keys quantized before RoPE: the last three cost an
extra pass over the history at every decode step in a real cache (``README``: why not built).
Prints per scheme the mean perplexity increase over texts and the worst text, per kind.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tiercache

from research import multitext, seeded, sensitivity, texts  # noqa: E402
from tiercache.models.load import load_model  # noqa: E402

G = 64
SHRINKS = [1.0 - 0.05 * i for i in range(11)]  # the range search: min/max shrunk about its middle
INT2_KEYS = "bench/reference/smollm2-135m-int2-keys-joint7-late-gain.yaml"  # hand-made: int2, 4 sinks, 7 int4 tensors
QUIET_VALUES = (1, 2, 3, 4, 7, 8, 10, 11, 12, 13, 16, 24, 25, 26, 27, 29)  # least int4-value gain on train text
SCHEMES = {
    "int2": {},
    "int2 +sinks": {"sinks": 4},
    "int2 +sinks +clip": {"sinks": 4, "clip": "mse"},
    "int2 +sinks +2 outliers/group": {"sinks": 4, "outliers": 2},
    "int2 +sinks pre-RoPE keys": {"sinks": 4, "prerope": True},
    "int2 +sinks +Hadamard(V)": {"sinks": 4, "hadamard": True},
    "K4V2 +sinks": {"sinks": 4, "key_bits": 4},
    "K2V4 +sinks": {"sinks": 4, "value_bits": 4},
    "K3V2 +sinks": {"sinks": 4, "key_bits": 3},
    "K3V1 +sinks +clipV": {"sinks": 4, "key_bits": 3, "value_bits": 1, "clip": "mse-values"},
    "K3V1 +sinks +clipV +Hadamard(V)": {"sinks": 4, "key_bits": 3, "value_bits": 1, "clip": "mse-values",
                                         "hadamard": True},
    "int2-keys-joint7": {"sinks": 4, "policy": INT2_KEYS},
    "int2-keys-joint7 +V1 on 16 quiet layers": {"sinks": 4, "policy": INT2_KEYS, "v1": QUIET_VALUES},
    "int2-keys-joint7 +V1 on 16 quiet layers +clipV": {"sinks": 4, "policy": INT2_KEYS, "v1": QUIET_VALUES,
                                                "clip": "mse-values"},
    "int4 +sinks +clip": {"sinks": 4, "bits": 4, "clip": "mse"},
    "K8V4 +sinks +clip": {"sinks": 4, "bits": 4, "key_bits": 8, "clip": "mse"},
    "K4V8 +sinks +clip": {"sinks": 4, "bits": 4, "value_bits": 8, "clip": "mse"},
    "int4 +sinks +clip +K8 on layers 17/18/20/23": {"sinks": 4, "bits": 4, "clip": "mse", "k8": (17, 18, 20, 23)},
}


def fake(x: torch.Tensor, dim: int, bits: int, search: bool) -> torch.Tensor:
    """Quantize-dequantize ``x`` with one affine range per group along ``dim``."""
    levels = 2**bits - 1
    lo0, hi0 = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    best = err = None
    for c in SHRINKS if search else [1.0]:
        mid = (lo0 + hi0) / 2
        lo, hi = mid + (lo0 - mid) * c, mid + (hi0 - mid) * c
        scale = ((hi - lo) / levels).clamp_min(1e-8)
        y = (x - lo).div(scale).round().clamp(0, levels) * scale + lo
        e = (y - x).pow(2).sum(dim, keepdim=True)
        best, err = (y, e) if best is None else (torch.where(e < err, y, best), torch.minimum(e, err))
    return best


def grouped(x: torch.Tensor, axis: str, bits: int, search: bool, outliers: int) -> torch.Tensor:
    """``x`` ``[B, H, T, D]``: ``channel`` groups are one channel over 64 tokens, ``token`` groups
    64 channels of one token; ``outliers`` per group (farthest from its median) kept exact."""
    b, h, t, d = x.shape
    v = x.reshape(b, h, t // G, G, d) if axis == "channel" else x.reshape(b, h, t, d // min(G, d), min(G, d))
    dim = 3 if axis == "channel" else 4
    if outliers:
        med = v.median(dim, keepdim=True).values
        mask = torch.zeros_like(v, dtype=torch.bool).scatter_(dim, (v - med).abs().topk(outliers, dim).indices, True)
        y = torch.where(mask, v, fake(torch.where(mask, med, v), dim, bits, search))
    else:
        y = fake(v, dim, bits, search)
    return y.reshape(b, h, t, d)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rope_tables(config, length: int):
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    freqs = torch.outer(torch.arange(length).float(), 1.0 / theta ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def layer_bits(scheme: dict, n_layers: int) -> list[tuple[int, int]]:
    """(key bits, value bits) per layer: a policy file's, else the scheme's (default 2), V1 layers."""
    if "policy" in scheme:
        from tiercache import load_policy
        from tiercache.models.spec import ModelSpec

        path = Path(__file__).resolve().parent.parent / scheme["policy"]
        spec = ModelSpec("probe", n_layers, ("full_attention",) * n_layers, 1, G)
        bits = [(lp.quantize.bits_of("keys"), lp.quantize.bits_of("values")) for lp in load_policy(path).resolve(spec)]
    else:
        b = scheme.get("bits", 2)
        bits = [(scheme.get("key_bits", b), scheme.get("value_bits", b))] * n_layers
    return [(8 if i in scheme.get("k8", ()) else k, 1 if i in scheme.get("v1", ()) else v)
            for i, (k, v) in enumerate(bits)]


def apply(scheme: dict, kv: list, config) -> list:
    clip = scheme.get("clip", "minmax")
    out, sinks = [], scheme.get("sinks", 0)
    for (k, v), (kb, vb) in zip(kv, layer_bits(scheme, len(kv))):
        k2, v2 = k, v
        if scheme.get("prerope"):
            cos, sin = rope_tables(config, k.shape[2])
            k2 = k * cos - rotate_half(k) * sin  # the keys before RoPE
        if scheme.get("hadamard"):
            v2 = v2 @ hadamard(v.shape[-1])
        kq = grouped(k2, "channel", kb, clip in ("mse", "mse-keys"), scheme.get("outliers", 0))
        vq = grouped(v2, "token", vb, clip in ("mse", "mse-values"), scheme.get("outliers", 0))
        if scheme.get("hadamard"):
            vq = vq @ hadamard(v.shape[-1]).T
        if scheme.get("prerope"):
            kq = kq * cos + rotate_half(kq) * sin
        kq[:, :, :sinks], vq[:, :, :sinks] = k[:, :, :sinks], v[:, :, :sinks]
        out.append((kq, vq))
    return out


def score(model, kv: list, ids: torch.Tensor, pre: seeded.Prefilled) -> float:
    """Mean nll of ``ids`` ``[M]`` after a past of ``kv`` (``pre``'s prompt, as quantized), in one forward."""
    from transformers import DynamicCache

    past = seeded.Prefilled(kv, pre.logits)
    return sensitivity.one_pass_nll(model, seeded.seed(DynamicCache(config=model.config), past), past, ids).mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--texts-per-kind", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--split", default="heldout", choices=["heldout", "train"])
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, from: {', '.join(SCHEMES)}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.schemes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"unknown scheme(s) {unknown}; allowed: {', '.join(SCHEMES)}")
    model, tok = load_model(args.model)
    nll: dict[str, dict[str, list[float]]] = {n: {} for n in ["full precision", *names]}
    for kind in texts.KINDS:
        ids = multitext.windows(tok, kind, args.texts_per_kind, args.prompt + args.tokens, split=args.split)
        for row in ids:
            pre = multitext.prefill(model, row[None, : args.prompt])
            kv = [(k.clone(), v.clone()) for k, v in pre.kv]
            nll["full precision"].setdefault(kind, []).append(score(model, kv, row[args.prompt:], pre))
            for n in names:
                nll[n].setdefault(kind, []).append(score(model, apply(SCHEMES[n], kv, model.config),
                                                         row[args.prompt:], pre))
    print(f"{args.model}, {args.split} split, {args.texts_per_kind} texts per kind, prompt {args.prompt}, "
          f"{args.tokens} tokens scored in one pass (fake quantization: a proxy, not the cache)\n")
    print("| scheme | code: mean Δ (worst text) | prose: mean Δ (worst text) |\n|---|---|---|")
    ref = nll["full precision"]
    for n in names:
        cells = []
        for kind in texts.KINDS:
            d = [100 * (math.exp(a - b) - 1) for a, b in zip(nll[n][kind], ref[kind])]
            cells.append(f"{sum(d) / len(d):+.2f}% ({max(d):+.1f}%)")
        print(f"| {n} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
