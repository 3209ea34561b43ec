"""State dicts of layers: the plain form every layer and processor saves and loads itself as.

A state dict is a flat ``dict[str, value]``: values are tensors (left where they live: views of
the layer's own buffers, never copies), ``None`` or plain JSON values (int, float, bool, str,
lists and dicts of those). A processor nests the state of what it wraps under a prefix
(``inner.`` for Offload, ``store.`` for Quantize's block store, ``buffer.`` / ``residual.`` for
the holders), so a whole chain is one flat dict that serialises to safetensors (the tensors)
plus JSON (the rest) with no pickle.

Helpers
    spec_state(spec) / spec_from(value)   a KVSpec as plain values and back
    nest(prefix, sd) / part(sd, prefix)   put a sub-state under a prefix / take it out
    expect(sd, kind, what)                ``CacheError`` unless the state is of that kind
    held_pair(sd, spec, tokens, where)    the ``keys`` / ``values`` tensors of a state, checked
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.spec import KVSpec
from tiercache.runtime import canonical_device

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int64,
    torch.float8_e4m3fn, torch.float8_e5m2)}


def dtype_from(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CacheError(f"state: unknown dtype {name!r}; allowed: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def spec_state(spec: KVSpec | None) -> dict | None:
    if spec is None:
        return None
    return {"batch": spec.batch, "heads": spec.heads, "key_dim": spec.key_dim, "value_dim": spec.value_dim,
            "dtype": str(spec.dtype).replace("torch.", ""), "device": str(canonical_device(spec.device))}


def spec_from(value) -> KVSpec | None:
    if value is None:
        return None
    try:
        ints = [value[f] for f in ("batch", "heads", "key_dim", "value_dim")]
        if not all(isinstance(x, int) and x >= 0 for x in ints):
            raise TypeError
        return KVSpec(*ints, dtype_from(value["dtype"]), canonical_device(value["device"]))
    except (KeyError, TypeError, RuntimeError) as e:
        raise CacheError(f"state: a layer spec needs batch, heads, key_dim, value_dim (ints), dtype and device; "
                         f"got {value!r}") from e


def nest(prefix: str, sd: dict) -> dict:
    return {prefix + k: v for k, v in sd.items()}


def part(sd: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def expect(sd, kind: str) -> None:
    if not isinstance(sd, dict):
        raise CacheError(f"state: expected a dict (a layer's state_dict), got {type(sd).__name__}")
    if sd.get("kind") != kind:
        raise CacheError(f"state: this is a {kind} layer; the state is of a {sd.get('kind')!r} layer "
                         "(load a state into the chain the same policy builds; use retier to change policy)")


def field(sd: dict, name: str, kind: str, type_=int):
    """``sd[name]``, checked to be a ``type_`` (an int is never a bool)."""
    v = sd.get(name)
    ok = isinstance(v, bool) if type_ is bool else isinstance(v, type_) and not isinstance(v, bool)
    if not ok or (type_ is int and v < 0):
        raise CacheError(f"state of a {kind} layer: field {name!r} should be a {type_.__name__}, got {v!r}")
    return v


def held_tensor(sd: dict, name: str, shape: tuple, dtype: torch.dtype, kind: str) -> torch.Tensor:
    """The tensor ``sd[name]``, checked to be of ``shape`` and ``dtype``."""
    t = sd.get(name)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
        raise CacheError(f"state of a {kind} layer: {name} should be {tuple(shape)} {dtype}, got {got}")
    return t


def held_pair(sd: dict, spec: KVSpec, tokens: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The held ``keys`` / ``values`` of a state, ``[B, H, tokens, D]`` as ``spec`` says."""
    return tuple(held_tensor(sd, name, (spec.batch, spec.heads, tokens, dim), spec.dtype, kind)
                 for name, dim in (("keys", spec.key_dim), ("values", spec.value_dim)))


def check_ingest(key, value, seen, kind: str, whole: bool) -> KVSpec:
    """The spec of an ingest's ``key``/``value`` (``[B, H, S, D]``, the newest ``S`` of ``seen``)."""
    spec = KVSpec.of(key, value)
    s = key.shape[2]
    if not isinstance(seen, int) or isinstance(seen, bool) or seen < s:
        raise CacheError(f"ingest into a {kind} layer: seen must be an int >= the {s} tokens given, got {seen!r}")
    if whole and seen != s:
        raise CacheError(f"ingest into a {kind} layer: it keeps every token, so it needs all {seen} seen "
                         f"tokens, got the last {s}")
    return spec
