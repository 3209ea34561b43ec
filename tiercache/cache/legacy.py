"""The legacy cache format: a tuple with one ``(key, value)`` pair of ``[B, H, S, D]`` tensors per layer.

    build(cls, past, policy, model, seq_length=None) -> cache
        what ``TieredCache.from_legacy`` returns (``cls`` is TieredCache): checked, then filled;
        for an encoder-decoder model the cache of ``cls.for_encoder_decoder``.
    check_past(past, model, policy, seq_length=None) -> (seen, batch)
        validate a legacy past against a ``ModelSpec`` and a ``Policy`` before anything is built;
        ``CacheError`` naming the layer and what was expected otherwise.
    fill(cache, past, seen)
        load each layer of a fresh ``TieredCache`` from its pair, once.
    export(layers) -> tuple[(keys, values), ...]
        each layer's K/V at full precision, as fresh tensors.
    split(past, model) -> (self_past, cross_past) / join(self_past, cross_past, n) -> past
        an encoder-decoder past (per layer ``(self key, self value, cross key, cross value)``, as
        transformers' ``EncoderDecoderCache`` iterates and old transformers returned) in halves,
        and back.

What a past means (``TieredCache.from_legacy`` / ``to_legacy``):
- ``seen``, the tokens the past stands for, is ``seq_length`` when given, else the longest
  layer's length. Full and static layers hold exactly ``seen`` tokens. A sliding layer may hold
  all of them or only the newest ``min(seen, window - 1)`` or more (what transformers'
  ``DynamicSlidingWindowLayer`` and a sliding tiercache layer keep): it still counts ``seen``
  tokens, so positions and masks continue where the past left off. A model whose layers are all
  sliding (Mistral) cannot tell from a trimmed past how many tokens came before: pass
  ``seq_length``.
- Models whose layers keep more than K/V (conv / recurrent states; indexer keys; DeepSeek-V4's
  compressor state) are refused both ways: a pair of tensors cannot carry that state.
- A KV-sharing ``reuse`` layer (Gemma 3n / 4) is never written by the model: its pair may be
  ``(None, None)`` or tensors, and is not stored; ``export`` gives ``(None, None)`` for it.
- ``None`` or ``()`` is the empty past: an empty cache, and an empty cache exports ``()``.
- Each layer is loaded by the layer protocol's bulk load, ``ingest(k, v, seen)``, not by
  attention steps. Quantized layers end in the same state as after any prefill of ``seen``
  tokens (the KIVI residual rule depends on the count alone). A quantized sliding layer given a
  trimmed past fills the part of its oldest block that the past no longer has with copies of
  the oldest token it has (outside the window, but in that block's statistics).
- A quantized sliding layer keeps whole blocks, so it may export up to a block more than
  ``window - 1`` tokens; those older than what a trimmed past held are those copies.
- Encoder-decoder models (``ModelSpec.cross_attention``): four tensors per layer; the cross
  half holds the encoder's tokens, all layers alike. ``from_legacy`` then returns the
  ``EncoderDecoderCache`` of ``TieredCache.for_encoder_decoder`` with both halves filled (and
  ``is_updated`` set, so the model reads cross-attention back instead of writing it again).
- ``export`` returns copies: an offloaded layer's device mirror is reused by the next layer, and
  a legacy tuple must not change when the cache does. Quantized layers export their dequantized
  values. The round trip ``from_legacy(past).to_legacy()`` gives ``past`` back bit for bit at full
  precision (sliding layers: the tokens they keep).
"""

from __future__ import annotations

from tiercache.errors import CacheError
from tiercache.layers.spec import check_pair
from tiercache.models.spec import SIDE_STATE_TYPES, ModelSpec
from tiercache.policy.schema import Policy


def build(cls, past, policy: Policy, model: ModelSpec, seq_length: int | None = None):
    _check_no_states([model.states(i) for i in range(model.num_layers)],
                     [t in SIDE_STATE_TYPES for t in model.layer_types], "from_legacy")
    if model.cross_attention:  # -> the EncoderDecoderCache of for_encoder_decoder, both halves filled
        halves = split(past, model)
        sizes = [check_past(halves[0], model, policy, seq_length)]
        try:  # cross-attention: full storage, all layers hold the encoder's tokens
            sizes.append(check_past(halves[1], model, Policy()))
        except CacheError as e:
            raise CacheError(f"cross-attention half: {e}") from e
        cache = cls.for_encoder_decoder(policy, model)
        parts = list(zip((cache.self_attention_cache, cache.cross_attention_cache), halves, sizes))
    else:
        seen, batch = check_past(past, model, policy, seq_length)
        cache = cls.from_policy(policy, model, batch_size=max(batch, 1), context_length=max(seen, 1))
        parts = [(cache, past, (seen, batch))]
    try:
        for half, half_past, (seen, _) in parts:
            fill(half, half_past, seen)
    except CacheError:
        cache.close()
        raise
    if model.cross_attention:  # the model reads cross-attention back instead of writing it again
        cache.is_updated = {i: cache.cross_attention_cache.get_seq_length(i) > 0 for i in range(model.num_layers)}
    return cache


def check_past(past, model: ModelSpec, policy: Policy, seq_length: int | None = None) -> tuple[int, int]:
    n = model.num_layers
    if seq_length is not None and (not isinstance(seq_length, int) or isinstance(seq_length, bool) or seq_length < 0):
        raise CacheError(f"from_legacy: seq_length must be an int >= 0 (tokens the past stands for), got {seq_length!r}")
    if past is None or (isinstance(past, (tuple, list)) and len(past) == 0):
        if seq_length:
            raise CacheError(f"from_legacy: an empty past stands for no tokens, got seq_length={seq_length}")
        return 0, 0
    if not isinstance(past, (tuple, list)):
        raise CacheError(f"from_legacy: past must be a tuple (or list) of {n} (key, value) pairs, one per layer of "
                         f"{model.name}; got {type(past).__name__}")
    if len(past) != n:
        raise CacheError(f"from_legacy: past has {len(past)} layers, expected {n} (key, value) pairs: "
                         f"one per layer of {model.name}")
    lengths, batch = [], None
    for i, pair in enumerate(past):
        length = _check_pair(i, pair, model)
        if length is None:
            continue
        b = pair[0].shape[0]
        if batch is not None and b != batch:
            raise CacheError(f"from_legacy: layer {i} has batch {b}, earlier layers have {batch}; every layer "
                             "must hold the same batch")
        batch = b
        lengths.append((i, length))
    if batch is None:
        raise CacheError("from_legacy: every layer's pair is (None, None); a past needs tensors for the layers "
                         "the model writes (use None or () for an empty past)")
    longest = max(length for _, length in lengths)
    seen = longest if seq_length is None else seq_length
    if seen < longest:
        raise CacheError(f"from_legacy: seq_length {seen} is less than the {longest} tokens a layer holds")
    for i, length in lengths:
        sliding = model.layer_types[i] != "full_attention"
        window = model.sliding_window or 1
        if not sliding and length != seen:
            raise CacheError(f"from_legacy: layer {i} holds {length} tokens, expected {seen}: every full-attention "
                             f"layer holds all the tokens the past stands for")
        if sliding and length < min(seen, window - 1):
            raise CacheError(f"from_legacy: sliding layer {i} holds {length} tokens, expected at least "
                             f"{min(seen, window - 1)} (the newest min(tokens, window - 1) of {seen}) and at most {seen}")
    if policy.storage == "static" and policy.max_length is not None and seen > policy.max_length:
        raise CacheError(f"from_legacy: the past holds {seen} tokens, more than static max_length "
                         f"{policy.max_length}; raise max_length or use storage: full")
    return seen, batch


def fill(cache, past, seen: int) -> None:
    """Load layer ``i`` of ``cache`` from ``past[i]``; ``check_past`` has accepted ``past``."""
    if past is None:
        return
    for i, (key, value) in enumerate(past):
        if key is None or cache.model.kv_sharing(i) == "reuse":
            continue
        cache._on(i, lambda layer: layer.ingest(key, value, seen))  # one bulk load; a refusal names the layer


def _check_no_states(states, sides, what: str) -> None:
    """Refuse layers that keep conv / recurrent states (``states``: counts) or a side state (``sides``: flags)."""
    for flags, kept in ((states, "conv / recurrent states (a hybrid or recurrent model)"), (sides, "a side state "
                        "beside their K/V (sparse attention's indexer keys, DeepSeek-V4's compressor state)")):
        if any(flags):
            raise CacheError(f"{what}: this model's layers {[i for i, f in enumerate(flags) if f]} keep {kept}, which "
                             "legacy (key, value) tuples cannot carry; use save / load or fork instead")


def export(layers) -> tuple:
    _check_no_states([getattr(layer, "states", 0) for layer in layers], [hasattr(layer, "side") for layer in layers],
                     "to_legacy")
    held = []
    for layer in layers:
        kv = layer.export()  # [B, H, S, D] views of storage for some layers: a legacy tuple is a copy
        held.append(None if kv is None else (kv[0].clone(), kv[1].clone()))
    if all(kv is None for kv in held):
        return ()
    return tuple((None, None) if kv is None else kv for kv in held)


def _check_pair(i: int, pair, model: ModelSpec) -> int | None:
    """Tokens in layer ``i``'s pair, or None for a ``(None, None)`` pair the layer may have."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        what = f"{type(pair).__name__} of {len(pair)}" if isinstance(pair, (tuple, list)) else type(pair).__name__
        raise CacheError(f"from_legacy: layer {i}: expected a (key, value) pair of tensors, got a {what}")
    key, value = pair
    if key is None and value is None and model.kv_sharing(i) == "reuse":
        return None
    try:
        check_pair(key, value)
    except CacheError as e:
        raise CacheError(f"from_legacy: layer {i}: {e}") from None
    if not key.is_floating_point():
        raise CacheError(f"from_legacy: layer {i}: key is {key.dtype}, expected a floating point dtype")
    heads, key_dim, value_dim = model.kv_shape(i)
    if (key.shape[1], key.shape[3], value.shape[3]) != (heads, key_dim, value_dim):
        raise CacheError(f"from_legacy: layer {i}: got {key.shape[1]} heads, key dim {key.shape[3]}, value dim "
                         f"{value.shape[3]}; {model.name} caches {heads} heads, key dim {key_dim}, value dim {value_dim}")
    return key.shape[2]


def split(past, model: ModelSpec) -> tuple:
    """``(self_past, cross_past)`` of an encoder-decoder legacy past; ``(None, None)`` for an empty one."""
    if past is None or (isinstance(past, (tuple, list)) and len(past) == 0):
        return None, None
    if not isinstance(past, (tuple, list)):
        raise CacheError(f"from_legacy: past must be a tuple (or list) of {model.num_layers} entries, one per decoder "
                         f"layer of {model.name}; got {type(past).__name__}")
    for i, entry in enumerate(past):
        if not isinstance(entry, (tuple, list)) or len(entry) != 4:
            got = f"a {type(entry).__name__} of {len(entry)}" if isinstance(entry, (tuple, list)) else type(entry).__name__
            raise CacheError(f"from_legacy: layer {i}: an encoder-decoder model's past has 4 tensors per layer "
                             f"(self-attention key, value, cross-attention key, value), got {got}")
    halves = tuple(tuple(e[:2]) for e in past), tuple(tuple(e[2:]) for e in past)
    return tuple(None if all(t is None for pair in h for t in pair) else h for h in halves)  # an empty half


def join(own: tuple, cross: tuple, n: int) -> tuple:
    """Per layer ``(self key, self value, cross key, cross value)``; ``()`` when both halves are empty."""
    if not own and not cross:
        return ()
    own, cross = own or ((None, None),) * n, cross or ((None, None),) * n
    return tuple((*a, *b) for a, b in zip(own, cross))
