"""TieredCache: one processor chain per model layer, behind transformers' ``Cache`` interface.

    cache = TieredCache.from_policy("configs/default.yaml", model.config)
    model.generate(**inputs, past_key_values=cache)      # or model(..., past_key_values=cache)
    cache.update(k, v, layer_idx)                         # any model that calls update works
    cache.nbytes()                                        # {"cpu": ..., "cuda:0": ..., "disk": ...}

It needs no ``cache_position``: each layer counts the tokens it has seen. Every transformers
cache method is answered by the chains (``tiercache.layers.base`` protocol), and errors from a
layer are re-raised as ``CacheError`` naming the layer index. ``cache.layers[i].keys`` /
``.values`` read what a layer holds at full precision (see ``KVLayer.keys`` for their cost).

``crop(x)`` follows transformers 5.x ``DynamicCache.crop``: ``x < 0`` removes ``-x`` tokens from
every layer, emptying it when ``-x`` is more than it holds; ``0`` only lets sliding layers trim
what they kept for a rollback; ``x > 0`` (transformers 4.x's "keep the first x") is refused with
``CacheError``, as transformers refuses it (use ``crop(x - cache.get_seq_length())``). A sliding
layer past its window refuses a crop whose result it cannot give exactly (the tokens before the
window are gone unless ``activate_past_recording()`` was called), all or nothing for the whole
cache: where transformers raises too, or (recording, past what was recorded) would silently keep
a wrong window. Where transformers crashes or goes wrong and the answer is clear, it is given:
crops of a never-written sliding layer are no-ops, a recorded layer cropped past its start is
empty (transformers' length would go negative), and ``crop(0)`` past the window is a no-op
(transformers raises).

KV sharing (Gemma 3n / Gemma 4): a layer that reuses another layer's K/V (``ModelSpec.kv_sharing
== "reuse"``) is transformers' placeholder (``DummyLayer``): ``is_dummy`` is True for it, it
holds nothing, refuses updates, ignores crop / reorder / select / reset, has no maximum length
(-1), is not sliding, and asking its sequence length or mask sizes raises ``CacheError``
(transformers raises ``ValueError``), except layer 0, which answers for the first layer that
stores.

Returned K/V may be views of internal buffers, valid until the next call on the cache (as with
transformers' own caches, attention consumes them at once).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from tiercache.chain import build_layers
from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer
from tiercache.model_spec import ModelSpec
from tiercache.policy import Policy, load_policy


class TieredCache(Cache):
    def __init__(self, layers: list[KVLayer], policy: Policy, model: ModelSpec, shared=None):
        super().__init__(layers=layers)
        self.policy = policy
        self.model = model
        self._shared = shared
        self._reuse = frozenset(i for i in range(len(layers)) if model.kv_sharing(i) == "reuse")

    @classmethod
    def from_policy(cls, policy, model_config, batch_size: int = 1, context_length: int | None = None) -> "TieredCache":
        """Build from a Policy, a YAML path or a dict, for a transformers config (or a ModelSpec).

        ``batch_size`` and ``context_length`` are only used by ``auto: true`` policies, which
        let the planner choose the least lossy rung that fits the budget; without a context
        length the policy's ``max_length`` is planned for, else 4096 tokens.
        """
        policy = load_policy(policy)
        model = model_config if isinstance(model_config, ModelSpec) else ModelSpec.from_config(model_config)
        if policy.auto:
            from tiercache.planner import check_sizes, choose

            context = context_length if context_length is not None else (policy.max_length or 4096)
            check_sizes(batch_size, context)
            policy = choose(policy, model, batch_size, context)
        layers, shared = build_layers(policy.resolve(model))
        return cls(layers, policy, model, shared)

    # -- the write path --------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self._layer(layer_idx)
        if layer_idx in self._reuse:
            raise CacheError(
                f"layer {layer_idx} reuses the K/V of an earlier layer (KV sharing, {self.model.name}): the model "
                "never writes it, and the cache refuses updates to it (transformers' placeholder layer does too)"
            )
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                raise CacheError(f"layer {layer_idx}: {name} must be floating point, got {t.dtype}")
        try:
            return layer.update(key_states, value_states)
        except CacheError as e:
            raise CacheError(f"layer {layer_idx}: {e}") from None

    # -- what transformers asks ------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._attention_layer(layer_idx, "get_seq_length").seq_length() if self.layers else 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._attention_layer(layer_idx, "get_mask_sizes").mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is None:
            return max(self.get_max_length(i) for i in range(len(self.layers)))
        layer = self._layer(layer_idx)
        return -1 if layer_idx in self._reuse else layer.max_length()

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding and i not in self._reuse for i, layer in enumerate(self.layers)]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        """True for the layers that reuse another layer's K/V (transformers' placeholder layers)."""
        return [i in self._reuse for i in range(len(self.layers))]

    @property
    def is_compileable(self) -> bool:
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        """transformers' meaning: every layer that stores has had an update since it was built or reset."""
        stores = [layer for i, layer in enumerate(self.layers) if i not in self._reuse]
        return bool(stores) and all(layer.is_initialized for layer in stores)

    @property
    def batch_size(self) -> int:
        """The batch the layers hold, -1 before any update. (transformers' ``DynamicCache`` always
        says -1, its layers do not track it; ``StaticCache`` gives the batch, as this does.) Reads
        one layer through ``peek()``: a quantized or offloaded one pays a full read."""
        for layer in self.layers:
            if layer.is_initialized:
                return layer.peek()[0].shape[0]
        return -1

    def early_initialization(self, *args, **kwargs) -> None:
        """Layers learn batch, heads, dtype and device from their first update: nothing to do."""

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Offloaded layers prefetch themselves (tiercache.processors.offload)."""

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Offloaded layers write back only new tokens themselves (tiercache.processors.offload)."""

    # -- whole-cache operations ----------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """transformers 5.x: ``crop(-n)`` removes the last ``n`` tokens (every token when ``n`` is more
        than held); ``crop(0)`` trims sliding layers after a rollback; a positive value is refused."""
        x = tokens_to_remove
        if not isinstance(x, int) or isinstance(x, bool):
            raise CacheError(
                f"crop(tokens_to_remove) needs an int <= 0 (-n: remove the last n tokens; 0: trim sliding layers "
                f"after a rollback), got {x!r}"
            )
        if x > 0:
            raise CacheError(
                f"crop({x}): a positive value is not supported (transformers 5.x refuses it too); pass -n to remove "
                f"the last n tokens, e.g. crop({x} - cache.get_seq_length()) keeps the first {x}"
            )
        # All or nothing: every layer validates first; sliding layers (the only ones that may
        # still refuse, having dropped tokens) are cropped before the others. Placeholder
        # layers (KV sharing: reuse) ignore crop, as transformers' do.
        order = sorted((i for i in range(len(self.layers)) if i not in self._reuse),
                       key=lambda i: not self.layers[i].is_sliding)
        self._each("validate_crop", -x, order=order)
        self._each("crop", -x, order=order)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each("reorder", beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each("select", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each("repeat_interleave", repeats)

    def reset(self) -> None:
        """Empty every layer and free the shared buffers (workspace, prefetch slots): ``nbytes()`` is {} after."""
        self._each("reset")
        if self._shared is not None:
            self._shared.close()  # re-created on demand

    def activate_past_recording(self) -> None:
        self._each("set_recording", True, order=[i for i in range(len(self.layers)) if i not in self._reuse])

    def is_recording_past(self, layer_idx: int) -> bool:
        return self._layer(layer_idx).record_past and layer_idx not in self._reuse

    def close(self) -> None:
        """Release every buffer and file now (also done when the cache is garbage-collected)."""
        self._each("close")
        if self._shared is not None:
            self._shared.close()

    # -- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        """Bytes held now, per place (``cpu``, ``cuda:0``, ``disk`` ...)."""
        total: dict[str, int] = {}
        holders = [*self.layers, *([self._shared] if self._shared is not None else [])]
        for holder in holders:
            for place, n in holder.nbytes().items():
                total[place] = total.get(place, 0) + n
        return total

    def shared_nbytes(self) -> dict[str, int]:
        """The part of ``nbytes()`` in buffers shared by all layers, per place: the dequantization
        workspace (one layer at full precision) and the offload prefetch slots (prefetch + 1
        layers). They do not grow with the number of layers; the rest is the per-layer state."""
        return self._shared.nbytes() if self._shared is not None else {}

    def __repr__(self) -> str:
        return f"TieredCache(policy={self.policy.name!r}, layers={len(self.layers)}, seen={self.get_seq_length()})"

    # -- internals -------------------------------------------------------------------------------
    def _layer(self, layer_idx: int) -> KVLayer:
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
            raise CacheError(f"layer_idx must be an int in 0..{len(self.layers) - 1}, got {layer_idx!r} "
                             f"({type(layer_idx).__name__})")
        if not 0 <= layer_idx < len(self.layers):
            raise CacheError(
                f"layer_idx {layer_idx!r} is out of range: this cache was built for {len(self.layers)} layers "
                f"({self.model.name})"
            )
        return self.layers[layer_idx]

    def _attention_layer(self, layer_idx: int, what: str) -> KVLayer:
        """The layer that answers ``what`` for ``layer_idx``: transformers' rule for placeholders."""
        layer = self._layer(layer_idx)
        if layer_idx not in self._reuse:
            return layer
        stores = [i for i in range(len(self.layers)) if i not in self._reuse]
        if layer_idx != 0 or not stores:
            raise CacheError(
                f"{what}(layer_idx={layer_idx}): layer {layer_idx} reuses the K/V of an earlier layer (KV sharing) "
                f"and tracks no sequence length; ask a layer that stores: {stores}"
            )
        return self.layers[stores[0]]

    def _each(self, method: str, *args, order=None) -> None:
        """Apply an operation to every layer; a layer's CacheError names its index."""
        for i in range(len(self.layers)) if order is None else order:
            try:
                getattr(self.layers[i], method)(*args)
            except CacheError as e:
                raise CacheError(f"layer {i}: {e}") from None
