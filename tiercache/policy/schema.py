"""Policies: frozen dataclasses; YAML and dicts are only their serialisation.

One generic loader (``tiercache.policy.fields.build``) walks the dataclass fields and their type hints, so no field is
restated anywhere (``Policy.from_plain`` is its hook: ``store.yaml``'s inline ladder rungs are built by it too): every bad input raises ``PolicyError`` with the field path, the value and
what is allowed. ``Policy.resolve(model)`` applies overrides and returns one ``LayerPolicy`` per
model layer, checking the policy against that model (indices in range, known layer types).

Choices where DESIGN.md is silent
- An override's ``quantize`` mapping is merged over the top-level ``quantize`` (so
  ``{bits: 2}`` changes only the bits); ``null`` turns it off; an absent key leaves it as is.
- Sliding-window layers are never offloaded unless an override names them (by index or by
  ``layer_type``) with an ``offload`` section: they are small, and offloading them is slower.
- ``offload.path`` defaults to the system temp directory for ``device: disk``.
- ``bits: 8`` with ``format: fp8`` selects e4m3 floating point (native backend only).
- ``experimental:`` inside a quantize section holds the knobs that served hand tuning and that
  ``tiercache tune`` does not search: ``key_gain`` and ``clip`` (``fields.py``'s ``experimental``
  metadata). Written at the section's top level they are still read, with a DeprecationWarning.
  An override's ``experimental`` mapping is merged over the top-level one's, key by key.
- ``key_gain`` (default 1.0: off) multiplies the keys attention reads of the packed tokens (not
  the sinks, not the residual): a quantized context loses attention against the exact tokens,
  which a gain above 1 gives back (docs/quality-study.md, "A gain on the quantized keys"). A number in (0, 4].
- ``budget.gpu_memory`` is the card a policy is written for (``24GB``: 24e9 bytes, as cards are
  sold; ``22GiB``: 22 * 2^30): the planner's verdict then also needs the whole run's device footprint
  (``tiercache.planner.whole``) to fit it; a value under 1 MiB is refused as a size without its unit.
- ``calibration`` (with ``auto: true``): the per-layer sensitivity ``tiercache tune`` saved (JSON); the
  auto ladder then offers a rung of per-layer formats chosen by it (``tiercache.planner.mixed``).
  A relative path is read from the working directory.
- ``cross_attention`` (encoder-decoder models, ``tiercache.planner.cross_attention``): its own ``quantize``
  / ``offload``, not merged with the top-level ones; omitted means full precision on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tiercache.errors import PolicyError
from tiercache.policy.backends import validate
from tiercache.policy.fields import UNSET, Size, build_fields, read_yaml, to_plain


MIN_CARD = 2**20  # Budget.gpu_memory below this is a size given without its unit (``24`` bytes)
MAX_KEY_GAIN = 4.0  # QuantizePolicy.key_gain: beyond a few tenths above 1 attention is only sharpened


@dataclass(frozen=True)
class QuantizePolicy:
    backend: Literal["native", "quanto", "hqq"] = "native"
    bits: int = 4
    group_size: int = 64
    residual_length: int = 128
    key_axis: Literal["channel", "token"] = "channel"
    value_axis: Literal["channel", "token"] = "token"
    format: Literal["int", "fp8"] = "int"
    sink_tokens: int = 0  # the first tokens seen stay in full precision (attention sinks); full-attention layers
    # experimental (under ``quantize.experimental:``; tiercache tune does not search them): the per-group
    # range, min/max or searched for least squared error (mse: keys and values; mse-values / mse-keys: that
    # tensor only, the other min/max)
    clip: Literal["minmax", "mse", "mse-values", "mse-keys"] = field(default="minmax", metadata={"experimental": True})
    key_bits: int | None = None  # the keys' bits when not ``bits`` (keys are the sensitive half: e.g. 4 on a few layers)
    value_bits: int | None = None  # the values' bits when not ``bits``
    meta_bits: int | None = None  # each group's scale and offset: None in the model dtype; 8 as one byte each
    # on grids of the block (quantize/metacodes.py): 0.27 bits per element for groups of 64 instead of 0.5 in bf16
    # experimental: attention reads the packed keys times this (1.0: as given); no bytes, no cost per step
    key_gain: float = field(default=1.0, metadata={"experimental": True})
    packed_attention: bool = True  # decode steps attend over the packed codes (quantize/packed_kv.py); false:
    # dequantize into a workspace, then the model's attention (the reference path); not part of the block format

    def bits_of(self, which: str) -> int:
        """Bits of ``"keys"`` or ``"values"``: ``key_bits`` / ``value_bits``, else ``bits``."""
        own = self.key_bits if which == "keys" else self.value_bits
        return self.bits if own is None else own


@dataclass(frozen=True)
class OffloadPolicy:
    device: Literal["cpu", "disk"] = "cpu"
    prefetch: int = 1
    pin_memory: bool = True
    path: str | None = None


@dataclass(frozen=True)
class Override:
    layers: tuple[int, ...] | None = None
    layer_type: str | None = None
    quantize: QuantizePolicy | None = UNSET
    offload: OffloadPolicy | None = UNSET


@dataclass(frozen=True)
class CrossAttentionPolicy:
    """Encoder-decoder models: how the cross-attention K/V (written once from the encoder output)
    are kept. Its own section, not merged with the top-level ``quantize`` / ``offload``: omitted
    (or ``null`` fields) means full precision on the compute device."""

    quantize: QuantizePolicy | None = None
    offload: OffloadPolicy | None = None


@dataclass(frozen=True)
class Budget:
    device: Size | None = None
    host: Size | None = None
    disk: Size | None = None
    scope: Literal["cache", "total"] = "cache"  # what a tier's size bounds: the cache, or the whole run (tiercache.planner.whole)
    # the card the policy is written for: the whole run's device footprint (weights, cache, activations,
    # runtime, margin) must fit it, whatever ``scope`` says; ``24GB`` is 24e9 bytes, ``22GiB`` 22 * 2**30
    gpu_memory: Size | None = None


@dataclass(frozen=True)
class LayerPolicy:
    """What one model layer gets after overrides: the input of the chain builder and planner."""

    index: int
    layer_type: str
    storage: str  # full | static | sliding
    window: int | None
    max_length: int | None
    quantize: QuantizePolicy | None
    offload: OffloadPolicy | None
    kv_sharing: str | None = None  # the model's: None | "store" (return owned K/V) | "reuse" (never updated)
    states: int = 0  # conv / recurrent state pairs the layer keeps exact (hybrid and recurrent models)
    attends: bool = True  # the layer caches attention K/V (False: a state-only or empty layer, storage "none")
    compress_rate: int | None = None  # DeepSeek-V4 compressed layers: tokens per compressed entry (exact side state)


KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention", "hybrid", "hybrid_sliding")
# (attention layers: their K/V is tiered; indexed / compressed layers also keep an exact side state, never tiered)
# Layers that keep a conv / recurrent state or nothing (tiercache.models.spec): never tiered, never named
NOT_ATTENTION = ("linear_attention", "conv", "mlp", "moe", "dummy")


@dataclass(frozen=True)
class Policy:
    name: str = "custom"
    description: str = ""
    storage: Literal["full", "static"] = "full"
    max_length: int | None = None
    quantize: QuantizePolicy | None = None
    offload: OffloadPolicy | None = None
    overrides: tuple[Override, ...] = ()
    budget: Budget | None = None
    auto: bool = False
    calibration: str | None = None  # auto: a sensitivity file of tiercache tune; the ladder then picks per-layer
    # formats by measured sensitivity (tiercache.planner.mixed) where no lossless rung fits
    cross_attention: CrossAttentionPolicy | None = None

    @classmethod
    def from_dict(cls, data: Any) -> "Policy":
        if not isinstance(data, dict):
            raise PolicyError(f"policy: expected a mapping of fields, got {type(data).__name__}")
        return cls.from_plain(data, "policy")

    @classmethod
    def from_plain(cls, data: Any, path: str) -> "Policy":
        """The generic loader's hook: a policy at ``path`` (``policy``, ``store.ladder[1]`` ...),
        override quantize sections merged over the top-level one, then checked."""
        if isinstance(data, dict):
            data = _merge_override_quantize(data)
        policy = build_fields(cls, data, path)
        policy._check(path)
        return policy

    def to_dict(self) -> dict:
        return to_plain(self)

    def _check(self, where: str = "policy") -> None:
        if self.max_length is not None and self.max_length < 1:
            raise PolicyError(f"{where}.max_length: must be >= 1 (tokens) or null, got {self.max_length}")
        if self.storage == "static" and self.max_length is None:
            raise PolicyError(f"{where}.max_length: storage 'static' needs max_length (tokens to preallocate), got null")
        if self.auto and (self.budget is None or (self.budget.device is None and self.budget.gpu_memory is None)):
            raise PolicyError(f"{where}.budget.device: auto: true needs a device budget (budget.device) or a card "
                              "(budget.gpu_memory) to fit, got none")
        card = self.budget.gpu_memory if self.budget is not None else None
        if card is not None and card < MIN_CARD:
            raise PolicyError(f"{where}.budget.gpu_memory: {int(card)} bytes is no GPU's memory; give the card with "
                              "its unit: 24GB (10^9 bytes, as cards are sold) or 22GiB (2^30 bytes)")
        if self.calibration is not None and not self.auto:
            raise PolicyError(f"{where}.calibration: {self.calibration!r} is read by auto: true only (it picks per-layer "
                              "formats within the budget); set auto: true, or use the policy tiercache tune wrote")
        if self.calibration is not None and not str(self.calibration).strip():
            raise PolicyError(f"{where}.calibration: an empty path; give the JSON file tiercache tune saved, or omit it")
        for i, q in _sections(self, "quantize", where):
            check_quantize(q, i)
        for i, o in _sections(self, "offload", where):
            _check_offload(o, i)
        for i, o in enumerate(self.overrides):
            at = f"{where}.overrides[{i}]"
            if (o.layers is None) == (o.layer_type is None):
                raise PolicyError(f"{at}: give exactly one of 'layers' (indices) or 'layer_type', got {to_plain(o)}")
            if o.layers is not None and not o.layers:
                raise PolicyError(f"{at}.layers: an empty list names no layer; give indices such as [0, -1]")
            if o.layer_type in NOT_ATTENTION:
                raise PolicyError(f"{at}.layer_type: {o.layer_type!r} layers are not attention layers: they keep their "
                                  "state exact on the model's device and no policy tiers them; overrides name attention "
                                  f"layer types only: {', '.join(KNOWN_LAYER_TYPES)}")
            if o.layer_type is not None and o.layer_type not in KNOWN_LAYER_TYPES:
                raise PolicyError(f"{at}.layer_type: unknown layer type {o.layer_type!r}; allowed: {', '.join(KNOWN_LAYER_TYPES)}")

    def resolve(self, model) -> list[LayerPolicy]:
        """One LayerPolicy per layer of ``model`` (a ``ModelSpec``), overrides applied in order.

        The sliding-window rule: a quantized sliding layer keeps the newest tokens exact as the
        KIVI residual does on any layer; one whose window fits in the residual
        (``window - 1 <= residual_length``: every token it ever holds is among the newest
        ``residual_length``) is not quantized at all, so after any update all it holds is exact,
        whatever the prompt length and however the state got there (prefill, decode, retier,
        ingest, load)."""
        n = model.num_layers
        attends = [model.attends(i) if hasattr(model, "attends") else True for i in range(n)]
        for i, o in enumerate(self.overrides):
            for idx in o.layers or ():
                if not -n <= idx < n:
                    raise PolicyError(f"policy.overrides[{i}].layers: index {idx} is out of range for a model with {n} layers; allowed: {-n}..{n - 1}")
                if not attends[idx % n]:
                    raise PolicyError(
                        f"policy.overrides[{i}].layers: layer {idx} is a {model.layer_types[idx % n]!r} layer, not an "
                        "attention layer: it keeps its state exact and no policy tiers it; name attention layers only: "
                        f"{[j for j in range(n) if attends[j]]}")
            if o.layer_type is not None and o.layer_type not in model.layer_types:
                raise PolicyError(
                    f"policy.overrides[{i}].layer_type: {o.layer_type!r} is not a layer type of this model; "
                    f"it has: {', '.join(sorted(set(model.layer_types)))}"
                )
        out = []
        for idx, layer_type in enumerate(model.layer_types):
            window = model.window(idx)
            states = model.states(idx) if hasattr(model, "states") else 0
            if not attends[idx]:  # a state-only or empty layer: exact, resident, untouched by the policy
                out.append(LayerPolicy(idx, layer_type, "none", None, None, None, None, model.kv_sharing(idx),
                                       states, attends=False))
                continue
            sliding = window is not None
            quantize, offload = self.quantize, (None if sliding else self.offload)
            for o in self.overrides:
                named = o.layer_type == layer_type if o.layer_type is not None else idx in {j % n for j in o.layers}
                if not named:
                    continue
                if o.quantize is not UNSET:
                    quantize = o.quantize
                if o.offload is not UNSET:
                    offload = o.offload
            if quantize is not None and sliding and window - 1 <= quantize.residual_length:
                quantize = None  # its whole window is newer than the residual: every token it holds stays exact
            storage = "sliding" if sliding else self.storage
            rate = model.compress_rate(idx) if hasattr(model, "compress_rate") else None
            out.append(LayerPolicy(idx, layer_type, storage, window, self.max_length, quantize, offload,
                                   model.kv_sharing(idx), states, compress_rate=rate))
        return out


def load_policy(source: "str | Path | dict | Policy") -> Policy:
    """A Policy from a YAML path, a dict or a Policy (returned as is)."""
    if isinstance(source, Policy):
        return source
    if isinstance(source, dict):
        return Policy.from_dict(source)
    if not isinstance(source, (str, Path)):
        raise PolicyError(f"a policy is a YAML file path, a dict or a Policy; got {type(source).__name__} {source!r}")
    data = read_yaml(source, "policy file")
    return Policy.from_dict(data if data is not None else {})


def _merge_override_quantize(data: dict) -> dict:
    base = data.get("quantize")
    overrides = data.get("overrides")
    if not isinstance(base, dict) or not isinstance(overrides, list):
        return data
    merged = []
    for o in overrides:
        if isinstance(o, dict) and isinstance(o.get("quantize"), dict):
            o = {**o, "quantize": _merge_quantize(base, o["quantize"])}
        merged.append(o)
    return {**data, "overrides": merged}


def _merge_quantize(base: dict, over: dict) -> dict:
    """An override's quantize mapping over the top-level one; their ``experimental`` mappings merged
    key by key, whichever spelling (top level or ``experimental``) the override uses winning."""
    from tiercache.policy.fields import EXPERIMENTAL

    out = {**base, **over}
    b, o = base.get(EXPERIMENTAL), over.get(EXPERIMENTAL)
    if isinstance(b, dict) and (o is None and EXPERIMENTAL not in over or isinstance(o, dict)):
        out[EXPERIMENTAL] = {k: v for k, v in {**b, **(o or {})}.items() if k not in over}
    for k in o if isinstance(o, dict) else ():
        if k in base and k not in over:
            out.pop(k)  # the top-level (old) spelling inherited from the base, replaced by the override's
    return out


def _sections(p: Policy, field: str, where: str = "policy"):
    """Every ``field`` section ("quantize" / "offload") of a policy, with where it is written."""
    if getattr(p, field) is not None:
        yield f"{where}.{field}", getattr(p, field)
    for i, o in enumerate(p.overrides):
        if getattr(o, field) not in (None, UNSET):
            yield f"{where}.overrides[{i}].{field}", getattr(o, field)
    if p.cross_attention is not None and getattr(p.cross_attention, field) is not None:
        yield f"{where}.cross_attention.{field}", getattr(p.cross_attention, field)


def check_quantize(q: QuantizePolicy, where: str) -> None:
    """A quantize section's own checks (bounds, what the backend supports), errors naming ``where``."""
    for name in ("group_size", "residual_length", "sink_tokens"):
        v = getattr(q, name)
        if v < (1 if name == "group_size" else 0):
            raise PolicyError(f"{where}.{name}: must be {'>= 1' if name == 'group_size' else '>= 0'}, got {v}")
    validate(q, where)
    if q.meta_bits is not None and (q.meta_bits != 8 or q.backend != "native" or q.format != "int"):
        raise PolicyError(f"{where}.meta_bits: allowed values are null (scales and offsets in the model dtype) and 8 "
                          f"(one byte each, backend native, format int); got meta_bits {q.meta_bits!r} with backend "
                          f"{q.backend!r}, format {q.format!r}")
    if not (isinstance(q.key_gain, (int, float)) and not isinstance(q.key_gain, bool)
            and 0 < q.key_gain <= MAX_KEY_GAIN):  # NaN fails both comparisons
        raise PolicyError(f"{where}.key_gain: allowed values are numbers in (0, {MAX_KEY_GAIN:g}] (1.0: the keys as "
                          f"given); got {q.key_gain!r}")
    for name, which in (("key_bits", "keys"), ("value_bits", "values")):
        if getattr(q, name) is not None:  # the tensor's own bits, checked as the backend's bits
            validate(dataclasses.replace(q, bits=q.bits_of(which)), f"{where}.{name}")


def _check_offload(o: OffloadPolicy, where: str) -> None:
    if o.prefetch < 0:
        raise PolicyError(f"{where}.prefetch: must be >= 0 (layers fetched ahead), got {o.prefetch}")
    if o.path is not None and o.device != "disk":
        raise PolicyError(f"{where}.path: only used with device: disk, got device {o.device!r}")
    if o.path is not None and not o.path.strip():
        raise PolicyError(f"{where}.path: an empty path; give a directory for the cache files, or omit it for "
                          "the system temp directory")
