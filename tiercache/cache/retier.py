"""``retier(cache, policy)``: move a live cache to another policy, in place, layer by layer.

No new prefill: each layer's state moves from its old chain to a chain the chain builder makes
for the new policy, then the old chain is closed before the next layer moves, so the extra
memory at any moment is about one layer (its export at full precision and its new state),
never a second whole cache.

How a layer moves
- Both quantized with the same block format and residual rule (``Quantize.can_adopt``: equal
  codecs, ``quantize/codec.CodecSpec``: backend, bits, group, axes, format, clip; the same
  residual length and sinks), e.g. int4 resident -> int4 on the host: ``new.adopt(old)``, the
  packed blocks move as they are (never re-quantized) and the residual is copied.
- Otherwise ``new.ingest(*old.export())``: lossless moves (device, host, disk; full, static,
  sliding) are bit-exact; into quantization the state is what a cache of the new policy fed the
  same tokens holds (KIVI residual rule), so the next logits are identical to such a cache's;
  out of quantization (or between two block formats) the values are the dequantized ones:
  tokens that were quantized stay as attention saw them, they are not restored.
- The recording flag (assisted decoding) is carried over, set before the state moves, so a
  recording sliding layer keeps the tokens it recorded (a later crop can still roll back).

``retier_all(caches, policy)`` moves several caches as one (the halves of an encoder-decoder
cache, ``TieredEncoderDecoderCache.retier``). Each cache says which layer policies it is made of
(``cache.layer_policies(policy, model)``: ``policy.resolve`` for a TieredCache, the policy's
``cross_attention`` section for a cross-attention half), so cross-attention layers stay such.

A ``CompileableCache`` stays one: its new layers are the compiled kinds of the new policy.

Refused before any layer moves (``CacheError``, the cache unchanged): a policy that does not
fit the model (overrides out of range ...), a policy a ``CompileableCache`` cannot hold
(``chain.check_compiled``: the layer and why), a static ``max_length`` below the tokens a layer
holds, an ``auto`` policy with no rung that fits. A failure while moving (a full disk) moves the
layers already moved (of every cache of ``retier_all``) back to their old chains (bit-exact for
lossless moves; a layer that was quantized on the way keeps the dequantized values) and raises
``CacheError``.
"""

from __future__ import annotations

from tiercache.cache.chain import Shared, build_layer, build_layers, check_compiled, compileable
from tiercache.errors import CacheError, PolicyError
from tiercache.layers.base import move_state
from tiercache.policy.schema import load_policy


def retier(cache, policy) -> None:
    retier_all([cache], policy)


def retiered(cache, policy):
    """``cache`` moved to ``policy`` (None: left as it is), closed when that fails (``load(policy=)``)."""
    if policy is not None:
        try:
            cache.retier(policy)
        except Exception:
            cache.close()
            raise
    return cache


def retier_all(caches: list, policy) -> None:
    """Move every cache of ``caches`` (the two halves of an encoder-decoder cache) to ``policy``, all
    or nothing: every cache is checked before any layer moves, and a failure while moving one puts
    back the layers of it and of the caches already moved. Each cache builds its targets with its
    own ``layer_policies(policy, model)`` (a cross-attention half: the policy's ``cross_attention``)."""
    try:
        policy = load_policy(policy)
        if policy.auto:  # one rung for all (the first cache: the self-attention half)
            from tiercache.planner.api import choose

            first = caches[0]
            policy = choose(policy, first.model, max(first.batch_size, 1), max(first.get_seq_length(), 1))
        plans = [cache.layer_policies(policy, cache.model) for cache in caches]
        for cache, targets in zip(caches, plans):
            if cache.compiled:  # a CompileableCache stays one: its new layers must be compileable
                for lp in targets:
                    check_compiled(lp)
    except PolicyError as e:
        raise CacheError(f"retier: {e}") from e
    for cache, targets in zip(caches, plans):
        _check(cache, targets)
    undo = []
    try:
        for cache, targets in zip(caches, plans):
            undo.append(_apply(cache, policy, targets))
    except BaseException:
        for back in reversed(undo):
            back()
        raise
    finally:
        for cache in caches:
            cache._index_layers()


def _check(cache, targets) -> None:
    for i, (layer, lp) in enumerate(zip(cache.layers, targets)):
        seen = layer.seq_length()
        if lp.storage == "static" and lp.max_length is not None and lp.max_length < seen:
            raise CacheError(f"retier: layer {i} holds {seen} tokens; the new policy's static max_length is "
                             f"{lp.max_length}; raise max_length or use storage: full (nothing moved)")


def _apply(cache, policy, targets):
    """Move ``cache``'s layers to chains of ``targets``; returns what moves them back (after success)."""
    before, old_policy = [layer.policy for layer in cache.layers], cache.policy
    new_layers, shared = build_layers(targets, cache.compiled)
    old_shared, moved = cache._shared, []
    for layer in cache.layers:  # device mirrors and the old workspace are not read while moving
        layer.evict()
    if old_shared is not None:  # (made again on use, also after a roll-back)
        old_shared.close()
    try:
        for i, new in enumerate(new_layers):
            _move(cache.layers[i], new, f"retier: layer {i}")
            cache.layers[i].close()
            cache.layers[i] = new
            moved.append(i)
    except BaseException:
        _roll_back(cache, moved, before, old_shared)
        shared.close()
        for new in new_layers[len(moved):]:
            new.close()
        raise
    cache._shared, cache.policy = shared, policy

    def undo() -> None:  # another cache of the same retier failed: this one goes back too
        for layer in cache.layers:
            layer.evict()
        _roll_back(cache, moved, before, old_shared)
        shared.close()
        cache._shared, cache.policy = old_shared, old_policy

    return undo


def _move(old, new, where: str) -> None:
    """Move ``old``'s state into the empty chain ``new`` (a function: its temporaries die here)."""
    try:
        move_state(old, new)
    except CacheError as e:
        new.close()
        raise CacheError(f"{where}: {e}") from e


def _roll_back(cache, moved: list[int], before: list, old_shared) -> None:
    """Move layers ``moved`` back to chains of their old layer policies ``before`` (old shared buffers)."""
    padded = cache.compiled or (bool(before) and all(compileable(lp) for lp in before))
    for i in moved:
        back = build_layer(before[i], old_shared if old_shared is not None else Shared(), padded)
        _move(cache.layers[i], back, f"retier roll-back: layer {i}")
        cache.layers[i].close()
        cache.layers[i] = back
