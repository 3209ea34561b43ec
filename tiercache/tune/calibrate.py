"""Per-layer sensitivity of keys and values to each candidate format, measured in few forwards.

Interface
    calibrate(model, ids, stretch, base=None, bits=BITS, sinks=None, residual=None, tick=None, deadline=None) -> Sensitivity
        ``ids``: ``[context]`` calibration tokens; the last ``stretch`` are scored, the rest is the
        prefix whose cache is perturbed. ``base``: the quantize fields the formats share
        (``DEFAULT_BASE`` merged under it); ``sinks`` / ``residual``: fixed, or None to measure
        among ``SINK_CHOICES`` by measurement. ``tick(n, label)``: progress; ``deadline``: a
        ``time.monotonic()`` past which ``TimeBudgetExceeded`` is raised between forwards.
    trials(num_layers, bits) -> int      forwards ``calibrate`` makes (for time estimates)
    CalibrationModel                     the prefix cache and the perturbed forwards (also what
                                         ``search`` asks for a measured uniform format)

How it measures (and why so)
- One full-precision prefill of the prefix into a transformers ``DynamicCache`` keeps every
  layer's K/V. One forward of the stretch over it gives the reference next-token distributions.
- A *trial* swaps some layers' K or V for their quantize-dequantize round trip (the real block
  codec, ``quantize.blocks.BlockCodec.roundtrip``, over the tokens the KIVI rule packs: after the
  sinks, before the residual, ``quantize.geometry.flush_split``) and runs the stretch again:
  ``stretch`` tokens attending a ``context``-token prefix, never a new prefill. The KLD of the
  stretch against the reference is the KLD that part adds.
- Measured per layer, per tensor: int4 and int2 (the formats that move the budget): ``4 L``
  forwards. int8's error is 17x smaller in amplitude (scale ``1/255`` vs ``1/15``) and the KLD of
  a small perturbation is quadratic in it, so each part's int8 KLD is estimated as its int4 KLD /
  289, then rescaled so that their sum matches one measured forward with every layer at int8: a
  first-order estimate checked on the whole, one forward instead of ``2 L``.
- Sinks, residual, the metadata's width and the group size are policy-wide choices
  (``policy_wide``: ``SINK_CHOICES`` x ``RESIDUAL_CHOICES`` x ``META_CHOICES`` x ``GROUP_CHOICES``,
  sinks / residual fixed when the caller says): the per-layer table is measured once, at the
  base's (no sinks, residual 128, metadata in the model dtype, groups of 64); each other choice
  costs one forward per measured bits with every layer at those bits, and its table is the base's
  scaled by that forward's KLD over the base's (``Sensitivity.variants``). The search runs the
  knapsack on each and keeps the best, each choice's bytes from the planner: one-byte metadata
  or groups of 128 free bytes that the knapsack spends on more bits where they matter most.
  Axes stay KIVI's (keys per channel, values per token).
- On SmolLM2-135M at 4k: 30 layers, 121 + ~40 stretch forwards of 128 tokens, against 180
  forwards for every (layer, tensor, bits) and ~180 prefills of 4k for one full run per part.
"""

from __future__ import annotations

import time

import torch

from tiercache.planner.mixed import Sensitivity
from tiercache.quantize.blocks import Codec
from tiercache.quantize.codec import CodecSpec
from tiercache.quantize.geometry import flush_split
from tiercache.tune.metrics import PREFILL_CHUNK, kld, log_probs

BITS = (8, 4, 2)
SINK_CHOICES = (0, 4)
RESIDUAL_CHOICES = (64, 128, 256)
META_CHOICES = (None, 8)  # each group's scale and offset in the model dtype, or one byte each (meta_bits)
GROUP_CHOICES = (64, 128)  # tokens (values: elements) per group: 128 halves the metadata
DEFAULT_BASE = {"backend": "native", "group_size": 64, "residual_length": 128, "key_axis": "channel",
                "value_axis": "token", "format": "int", "sink_tokens": 0}
INT8_FROM_INT4 = (15 / 255) ** 2  # KLD ratio of a quadratic response to the quantization step


class TimeBudgetExceeded(RuntimeError):
    """The calibration (or the search) ran past ``--time-budget``."""


def policy_wide(base: dict, sinks: int | None = None, residual: int | None = None) -> list[dict]:
    """Every policy-wide choice (sinks x residual x metadata x group size) the base is measured
    against, as quantize fields; ``sinks`` / ``residual`` fixed when given. A residual shorter than
    the group is left out (the KIVI rule flushes whole groups: it would be the group's length)."""
    out = []
    for s_ in SINK_CHOICES if sinks is None else (sinks,):
        for r in RESIDUAL_CHOICES if residual is None else (residual,):
            for m in META_CHOICES:
                for g in GROUP_CHOICES:
                    if r < g:
                        continue
                    out.append({"sink_tokens": s_, "residual_length": r, "meta_bits": m, "group_size": g})
    return out


def trials(num_layers: int, bits=BITS, sinks: int | None = None, residual: int | None = None) -> int:
    measured = [b for b in bits if b != 8] if 8 in bits and 4 in bits else list(bits)
    base = {**DEFAULT_BASE, **({} if sinks is None else {"sink_tokens": sinks}),
            **({} if residual is None else {"residual_length": residual})}
    combos = len(policy_wide(base, sinks, residual))
    scale_bits = len([b for b in bits if b != 8] or bits)
    return (2 * num_layers * len(measured) + (1 if 8 in bits and 4 in bits else 0)
            + (combos * scale_bits if combos > 1 else 0))


def full_attention_layers(model) -> list[int]:
    from tiercache.models.spec import ModelSpec

    spec = ModelSpec.from_config(model.config)
    return [i for i in range(spec.num_layers) if spec.attends(i) and spec.window(i) is None]


class CalibrationModel:
    """A prefix's full-precision cache and the stretch forwards over perturbed copies of it."""

    @torch.no_grad()
    def __init__(self, model, ids: torch.Tensor, stretch: int):
        from transformers import DynamicCache

        from tiercache.cache.compat import cache_arg

        if not 1 <= stretch < ids.numel():
            raise ValueError(f"calibrate: stretch {stretch} must be >= 1 and < the {ids.numel()} calibration tokens")
        self.model, self.cache_arg = model, cache_arg
        x = ids.to(model.device)[None]  # [1, T]
        self.prefix, self.stretch = x[:, :-stretch], x[:, -stretch:]  # [1, P], [1, S]
        self.cache = DynamicCache(config=model.config)
        for s in range(0, self.prefix.shape[1], PREFILL_CHUNK):
            model(input_ids=self.prefix[:, s : s + PREFILL_CHUNK], **cache_arg(self.cache), use_cache=True)
        self.saved = [(layer.keys, layer.values) for layer in self.cache.layers]  # [1, H, P, D] each
        self.ref_logp = self.forward({})  # [S, V]

    @torch.no_grad()
    def forward(self, perturbed: dict) -> torch.Tensor:
        """Log-probs ``[S, V]`` of the stretch with ``perturbed`` ``{layer: (keys, values)}`` swapped in."""
        for i, layer in enumerate(self.cache.layers):
            layer.keys, layer.values = perturbed.get(i, self.saved[i])
        logits = self.model(input_ids=self.stretch, **self.cache_arg(self.cache), use_cache=True).logits[0]
        return log_probs(logits)

    def kld(self, perturbed: dict) -> float:
        return float(kld(self.ref_logp, self.forward(perturbed)).mean())

    def roundtrip(self, layer: int, which: str, bits: int, base: dict) -> torch.Tensor:
        """Layer ``layer``'s saved keys or values with the tokens the KIVI rule packs round-tripped."""
        from tiercache.policy.schema import QuantizePolicy

        x = self.saved[layer][0 if which == "keys" else 1]  # [1, H, P, D]
        q = QuantizePolicy(**{**base, "bits": bits, "key_bits": None, "value_bits": None})
        codecs = Codec(CodecSpec.of(q)).for_kv(x.shape[-1], x.shape[-1], x.dtype)
        codec = codecs[0 if which == "keys" else 1]
        sinks = q.sink_tokens
        n = flush_split(0, max(x.shape[2] - sinks, 0), q.residual_length, q.group_size)
        if n == 0:
            return x
        y = x.clone()
        y[:, :, sinks : sinks + n] = codec.roundtrip(x[:, :, sinks : sinks + n].contiguous())
        return y

    def uniform(self, layers, key_bits: int, value_bits: int, base: dict) -> dict:
        return {l: (self.roundtrip(l, "keys", key_bits, base), self.roundtrip(l, "values", value_bits, base))
                for l in layers}


def calibrate(model, ids: torch.Tensor, stretch: int, base: dict | None = None, bits=BITS, sinks: int | None = None,
              residual: int | None = None, tick=None, deadline: float | None = None, calib: CalibrationModel | None = None) -> Sensitivity:
    tick = tick or (lambda n, label: None)
    base = {**DEFAULT_BASE, **(base or {})}
    bits = tuple(sorted(set(bits), reverse=True))
    started = time.monotonic()
    calib = calib or CalibrationModel(model, ids, stretch)
    layers = full_attention_layers(model)

    def check_time():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeBudgetExceeded("calibration ran past --time-budget; raise it, or lower --context / --stretch")

    meta = {}
    if sinks is not None:
        base = {**base, "sink_tokens": sinks}
    if residual is not None:
        base = {**base, "residual_length": residual}
    estimate8 = 8 in bits and 4 in bits
    measured = [b for b in bits if not (estimate8 and b == 8)]
    table = {"keys": {l: {} for l in layers}, "values": {l: {} for l in layers}}
    for l in layers:
        for which in ("keys", "values"):
            for b in measured:
                check_time()
                tensor = calib.roundtrip(l, which, b, base)
                pair = (tensor, calib.saved[l][1]) if which == "keys" else (calib.saved[l][0], tensor)
                table[which][l][b] = calib.kld({l: pair})
                tick(1, f"layer {l} {which} int{b}")
    if estimate8:
        check_time()
        whole8 = calib.kld(calib.uniform(layers, 8, 8, base))
        tick(1, "int8")
        guess = {w: {l: table[w][l][4] * INT8_FROM_INT4 for l in layers} for w in table}
        total = sum(sum(d.values()) for d in guess.values())
        scale = whole8 / total if total > 0 else 0.0
        for w in table:
            for l in layers:
                table[w][l][8] = guess[w][l] * scale
        meta["int8_uniform_measured"] = whole8
    variants = []
    combos = policy_wide(base, sinks, residual)
    if len(combos) > 1:
        scale_bits = [b for b in bits if b != 8] or list(bits)
        ref = {}
        for b in scale_bits:
            check_time()
            ref[b] = calib.kld(calib.uniform(layers, b, b, base))
            tick(1, f"uniform int{b}")
        for fields in combos:
            if all(base.get(k) == v for k, v in fields.items()):
                continue
            scale = {}
            for b in scale_bits:
                check_time()
                got = calib.kld(calib.uniform(layers, b, b, {**base, **fields}))
                scale[b] = got / ref[b] if ref[b] > 0 else 1.0
                tick(1, " ".join(f"{k} {v}" for k, v in fields.items()) + f" int{b}")
            for b in bits:
                scale.setdefault(b, scale[4] if 4 in scale else scale[min(scale)])
            variants.append({**fields, "scale": scale})
        meta["uniform_base"] = {f"int{b}": v for b, v in ref.items()}
    meta.update(stretch=int(calib.stretch.shape[1]), prefix=int(calib.prefix.shape[1]),
                seconds=round(time.monotonic() - started, 1))
    return Sensitivity(tuple(layers), bits, table["keys"], table["values"], base, meta, variants)
