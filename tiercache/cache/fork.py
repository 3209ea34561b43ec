"""``fork(cache)``: an independent copy (``TieredCache.fork``, ``copy.deepcopy``, ``copy.copy``).

The copy is built by the chain builder from the layer policies the cache's chains were built
from (``layer.policy``), in the cache's mode (a ``CompileableCache`` forks into one, its
layers the same compiled kinds), then each layer loads the original's ``state_dict()``: tensors are
copied onto the copy's own tiers (disk-tier contents into files of its own, never shared), its
prefetcher knows only its own layers, no device mirror is carried over, and the shared
dequantization workspace is its own. Writing to one never shows in the other.
"""

from __future__ import annotations

import copy

from tiercache.cache.chain import build_layers
from tiercache.errors import CacheError


def fork(cache):
    layers, shared = build_layers([layer.policy for layer in cache.layers], cache.compiled)
    twin = type(cache)(layers, cache.policy, cache.model, shared, cache.model_type)
    try:
        for i, (mine, theirs) in enumerate(zip(cache.layers, twin.layers)):
            try:
                theirs.load_state_dict(mine.state_dict())
            except CacheError as e:
                raise CacheError(f"fork: layer {i}: {e}") from e
    except BaseException:
        twin.close()
        raise
    twin.token_ids = copy.deepcopy(cache.token_ids)
    return twin
