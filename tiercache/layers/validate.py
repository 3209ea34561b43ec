"""An update is validated once: the one check of ``update(key, value)`` input, before any layer changes.

    check_update(layer, key, value, model=False, room=True)
        ``CacheError`` saying what was wrong and what is allowed, unless ``layer`` takes the pair:
        - the pair: two ``torch.Tensor`` of rank 4 ``[B, H, T, D]`` that agree on batch, heads,
          tokens, dtype and device (``check_pair``); ``model=True`` (the cache): floating point
          too, a model's K/V (layers themselves also hold packed ``uint8`` rows: Quantize's store);
        - the layout: what the layer holds (``layer.layout()``, a ``KVSpec``; None before its
          first update, then any layout is learnt): batch, kv heads, key / value head dims, dtype
          and device must match (a layout with ``device=None`` takes any device: an offloaded
          layer not yet bound to a compute device; devices compare in their canonical form,
          ``runtime.canonical_device``: a layout on ``cuda`` takes tensors on ``cuda:0``);
        - the room: a bounded layer that does not slide (static storage, quantized or not,
          offloaded or not: ``max_length() > 0``) must have room for ``T`` more tokens
          (``room=False``: the caller knows the layer is not bounded; the cache's table says it).
    takes_update(layer, key, value) -> bool
        The decode step's form of ``check_update(model=True, room=False)``: True when it would
        pass on its fast path (the held layout takes the pair); the cache then appends at once.
    check_layer_index(layer_idx, n, model_name)
        The cache's: ``layer_idx`` is an int in ``0..n-1`` (``n`` layers built for ``model_name``).
    check_room(layers, t)
        The cache's view of the room: a forward writes its layers one by one, so its first write
        refuses ``t`` tokens that any bounded layer (index -> layer) has no room for, before any
        layer takes them (else a sliding layer before a full static one would count tokens the
        static one then refuses, and the layers would disagree on the tokens seen). Under
        ``torch.compile`` a static layer counts on the device (a host count would recompile the
        step per token), so the room is checked eagerly only (the prefill's update).

Who calls it (the design). ``TieredCache.update`` calls ``check_update`` once, on the chain of
``layer_idx`` (after the index and KV-sharing placeholders are checked; a refusal names the
layer), then ``check_room`` on a forward's first write, then ``layer.append(key, value)``; for a
layer with no room to check whose layout takes the pair (``takes_update``: a decode step), it
appends at once. A ``full`` layer's decode step comes before even that: ``FullLayer.step`` writes
the token with ``index_copy_``, which takes only a source of the held shape, dtype and device (the
checks of ``takes_update``, made by torch); a pair it refuses comes here, which says why.
``KVLayer.update`` (a layer used on its own, as tests do) is ``check_update(self, ...)`` then
``self.append(...)``: the same checks, once, at the outermost layer called. ``append`` trusts
its input: a processor appends to the layer it wraps (``inner.append``, ``store.append``) what
it derived from a checked input, with no check of its own at each level.

Not checked here, because they are not facts about the input's shape: non-finite values
(``Quantize``'s FiniteGuard; on CUDA it is read without a host sync, so it belongs to the
layer's step), a disk tier out of space, device memory for an offload mirror. Each is still a
``CacheError`` from the layer (see those modules for when it surfaces and what it leaves).
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.spec import KVSpec, check_pair
from tiercache.runtime import canonical_device

_FIELDS = (
    ("batch", "batch size (use select / repeat_interleave / reorder to change it)"),
    ("heads", "kv head count"),
    ("key_dim", "key head dim"),
    ("value_dim", "value head dim"),
    ("dtype", "dtype"),
    ("device", "device"),
)


def takes_update(layer, key: torch.Tensor, value: torch.Tensor) -> bool:
    """The decode step's check, with no room to check: whether ``layer`` holds a layout of a
    model's (floating-point) K/V that the pair matches (``check_update(model=True, room=False)``
    passes exactly then; when False, it says what is wrong, if anything)."""
    held = layer.layout()
    return held is not None and held.dtype.is_floating_point and held.takes(key, value)


def check_update(layer, key: torch.Tensor, value: torch.Tensor, model: bool = False, room: bool = True) -> None:
    held = layer.layout()
    if held is not None and (not model or held.dtype.is_floating_point) and held.takes(key, value):
        if room:  # the decode step's path: the layout it holds
            check_room({None: layer}, key.shape[2])
        return
    if model:
        for name, t in (("key_states", key), ("value_states", value)):
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                raise CacheError(f"{name} must be floating point, got {t.dtype}")
    check_pair(key, value)
    if held is not None:
        got = KVSpec.read(key, value)
        for field, what in _FIELDS:
            want = getattr(held, field)
            if want is not None and getattr(got, field) != want:
                if field == "device" and canonical_device(want) == got.device:
                    continue
                raise CacheError(f"{what}: the layer holds {want}, the update has {getattr(got, field)}")
    if room:
        check_room({None: layer}, key.shape[2])


def check_layer_index(layer_idx, n: int, model_name: str) -> None:
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
        raise CacheError(f"layer_idx must be an int in 0..{n - 1}, got {layer_idx!r} ({type(layer_idx).__name__})")
    if not 0 <= layer_idx < n:
        raise CacheError(f"layer_idx {layer_idx!r} is out of range: this cache was built for {n} layers ({model_name})")


def check_room(layers: dict, t: int) -> None:
    if torch.compiler.is_compiling():  # (module docstring)
        return
    for i, layer in layers.items():
        limit = layer.max_length()
        if not layer.is_sliding and limit > 0 and layer.seq_length() + t > limit:
            where = "" if i is None else f"layer {i}: "
            raise CacheError(f"{where}static storage is full: it holds {layer.seq_length()} of max_length={limit} "
                             f"tokens and cannot take {t} more; raise max_length in the policy or use storage: full")
