"""TieredCache: one processor chain per model layer, behind transformers' ``Cache`` interface.

    cache = TieredCache.from_policy("configs/default.yaml", model.config)
    model.generate(**inputs, cache=cache)                # or model(..., cache=cache); past_key_values= on
                                                          # older transformers (tiercache.cache.compat.CACHE_KW)
    cache.update(k, v, layer_idx)                         # any model that calls update works
    cache.nbytes()                                        # {"cpu": ..., "cuda:0": ..., "disk": ...}
    cache.offload_stats()     # offload counters: bytes_h2d, bytes_d2h, fetches, side_fetches, host_waits

It needs no ``cache_position``: each layer counts the tokens it has seen. Every transformers
cache method is answered by the chains (``tiercache.layers.base`` protocol); a layer's
``CacheError`` is re-raised naming the layer index. An update is checked once, here
(``tiercache.layers.validate``), then appended to the chain, which trusts it. Which layer is a
KV-sharing placeholder, stores K/V or keeps a conv / recurrent state (``StateLayer``,
``tiercache.cache.state_layer``) is one table made at construction (``tiercache.cache.layer_roles``).
Returned K/V may be views of internal buffers, valid until the next call on the cache.

Lifecycle: ``fork()`` (= ``copy.deepcopy``) and ``retier(policy)`` (``tiercache.cache.fork`` /
``retier``), ``save`` / ``load`` (``tiercache.lifecycle``), ``release_transients()`` (free the workspace and prefetch slots of a cache set aside);
legacy tuples (``tiercache.cache.legacy``): ``from_legacy`` / ``to_legacy``; encoder-decoder models:
``for_encoder_decoder(policy, config)`` -> ``TieredEncoderDecoderCache`` (transformers'
``EncoderDecoderCache`` of two TieredCaches, the cross half per ``tiercache.planner.cross_attention``;
what the pair does: ``tiercache.cache.encoder_decoder``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from tiercache.cache import accounting, inputs
from tiercache.cache.chain import Shared, build_layers
from tiercache.cache.encoder_decoder import EncoderDecoderPair
from tiercache.planner.cross_attention import check_supported, cross_layer_policies
from tiercache.cache.layer_roles import LayerRoles
from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer
from tiercache.layers.validate import check_layer_index, check_room, check_update, takes_update
from tiercache.models.spec import ModelSpec, model_type_of, spec_of
from tiercache.policy.schema import Policy, load_policy


class TieredCache(Cache):
    compiled = False  # the chain builder's mode for this class (``CompileableCache``: True)

    def __init__(self, layers: list[KVLayer], policy: Policy, model: ModelSpec, shared=None,
                 model_type: str | None = None):
        super().__init__(layers=layers)
        self.policy = policy
        self.model = model
        self.model_type = model_type  # the config's model_type (part of a save's model fingerprint)
        self.token_ids: list | None = None  # set by load() when the save had them
        self._shared = shared if shared is not None else Shared()  # what the layers share (workspace, prefetcher)
        self._roles = LayerRoles(model, len(layers))  # placeholders, K/V and state layers: fixed at construction
        self._index_layers()

    @classmethod
    def _build(cls, policy: Policy, model: ModelSpec, model_type: str | None = None) -> "TieredCache":
        """An empty cache of a concrete (not ``auto``) policy: the chain builder is the only constructor."""
        layers, shared = build_layers(cls.layer_policies(policy, model), cls.compiled)
        return cls(layers, policy, model, shared, model_type)

    @classmethod
    def layer_policies(cls, policy: Policy, model: ModelSpec) -> list:
        """The layer policies this class builds for ``policy`` (``_build``, ``retier``, ``load``): a hook."""
        return policy.resolve(model)

    @classmethod
    def from_policy(cls, policy, model_config, batch_size: int = 1, context_length: int | None = None) -> "TieredCache":
        """Build from a Policy, a YAML path or a dict, for a transformers config (or a ModelSpec);
        ``batch_size`` and ``context_length`` plan an ``auto: true`` policy (``tiercache.cache.inputs``)."""
        return cls._build(*inputs.resolve(policy, model_config, batch_size, context_length))

    @classmethod
    def from_legacy(cls, past, policy, model_config, *, seq_length: int | None = None) -> "TieredCache":
        """A cache holding a legacy past (old transformers' per-layer tuples of tensors; ``seq_length``: the
        tokens a trimmed all-sliding past stands for): ``tiercache.cache.legacy``."""
        from tiercache.cache import legacy

        return legacy.build(cls, past, load_policy(policy), spec_of(model_config), seq_length)

    def to_legacy(self) -> tuple:
        """Per layer ``(keys, values)`` at full precision, fresh tensors (``()`` when empty)."""
        from tiercache.cache import legacy

        return legacy.export(self.layers)

    @classmethod
    def for_encoder_decoder(cls, policy, model_config) -> "TieredEncoderDecoderCache":
        """What ``generate(cache=...)`` takes for BART, T5, Whisper ...: an ``EncoderDecoderCache`` of
        two TieredCaches, self-attention per the policy, cross-attention per its ``cross_attention:`` section."""
        check_supported(model_config)
        policy, model = load_policy(policy), spec_of(model_config)
        cross = CrossAttentionCache._build(policy, model, model_type_of(model_config))  # PolicyError: decoder-only
        return TieredEncoderDecoderCache(cls.from_policy(policy, model), cross)

    # -- the write path --------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Checked once, here (``tiercache.layers.validate``), then appended to the chain, which
        trusts it. A decode step of a layer with no room to check (``_plain``) costs a set lookup
        and the layout check (``takes_update``: the layout takes the pair), or for a ``full``
        layer (``_steps``) only its write, whose ``index_copy_`` refuses what the layout would
        not take (then checked here, to say why); anything else takes
        ``_update``: the room of the bounded layers (static storage) is checked at a forward's
        first write, and per layer for them only; input the layout does not take is explained."""
        if type(layer_idx) is not int:
            return self._update(key_states, value_states, layer_idx)
        step = self._steps.get(layer_idx)
        if step is not None and type(key_states) is torch.Tensor and type(value_states) is torch.Tensor:
            try:
                out = step(key_states, value_states)
            except (RuntimeError, IndexError):  # torch refused the pair: the checks below say why
                out = None
            if out is not None:
                return out
        if layer_idx in self._plain:
            layer = self.layers[layer_idx]
            if takes_update(layer, key_states, value_states):
                try:
                    return layer.append(key_states, value_states)
                except CacheError as e:
                    raise CacheError(f"layer {layer_idx}: {e}") from e
        return self._update(key_states, value_states, layer_idx)

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx):
        if type(layer_idx) is not int or layer_idx not in self._roles.writable:
            self._layer(layer_idx)  # CacheError: not a layer index of this cache
            self._roles.check_update(layer_idx)  # CacheError: a KV-sharing placeholder
        layer = self.layers[layer_idx]
        try:
            check_update(layer, key_states, value_states, model=True, room=layer_idx in self._bounded)
        except CacheError as e:
            raise CacheError(f"layer {layer_idx}: {e}") from e
        if layer_idx == self._roles.first and self._bounded:
            check_room(self._bounded, key_states.shape[2])
        try:
            return layer.append(key_states, value_states)
        except CacheError as e:
            raise CacheError(f"layer {layer_idx}: {e}") from e

    def _index_layers(self) -> None:
        """Re-read what the write path keeps of the layers (which are bounded, which slide):
        at construction, and by ``retier`` after it swaps chains."""
        roles, layers = self._roles, self.layers
        self._bounded = {i: layers[i] for i in roles.kv_layers
                         if not layers[i].is_sliding and layers[i].max_length() > 0}  # static storage: has a room
        self._sliding = [layer.is_sliding and i not in roles for i, layer in enumerate(layers)]
        # The layers whose update has no room to check: the writable ones not bounded, but for the
        # forward's first write when some layer is (it checks the room of all of them).
        self._plain = frozenset(i for i in roles.writable if i not in self._bounded
                                and not (i == roles.first and self._bounded))
        # Of those, the layers that write a decode step's token with torch's checks alone (FullLayer.step)
        self._steps = {i: step for i in self._plain if (step := getattr(layers[i], "step", None)) is not None}

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
        return -1 if layer_idx in self._roles else layer.max_length()

    @property
    def is_sliding(self) -> list[bool]:
        return list(self._sliding)

    @property
    def is_linear(self) -> list[bool]:
        """True for the layers with a conv / recurrent state and no attention (transformers' meaning)."""
        return list(self._roles.is_linear)

    @property
    def is_dummy(self) -> list[bool]:
        """True for KV-sharing placeholders and layers that cache nothing (``mlp`` / ``moe`` of hybrid models)."""
        return list(self._roles.is_dummy)

    # -- conv / recurrent states (hybrid models): the layer's StateLayer answers ---------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._stateful(layer_idx, "get_conv_state").conv_state(state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._stateful(layer_idx, "update_conv_state").update_conv_state(conv_states, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._stateful(layer_idx, "get_recurrent_state").recurrent_state(state_idx)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        layer = self._stateful(layer_idx, "update_recurrent_state")
        return layer.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        i = self._roles.last_stateful() if layer_idx is None else layer_idx  # transformers: the last
        return self._stateful(i, "has_previous_state").has_previous_state(state_idx)

    @property
    def is_compileable(self) -> bool:
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        """transformers' meaning: every layer that stores has had an update since it was built or reset."""
        stores = [i for i in self._roles.kv_layers if not self._roles.has_state[i]]  # (not hybrid ones)
        return bool(stores) and all(self.layers[i].is_initialized for i in stores)

    @property
    def batch_size(self) -> int:
        """The batch held, -1 before any update (as StaticCache; DynamicCache always says -1)."""
        return next((batch for batch in (layer.batch_size() for layer in self.layers) if batch is not None), -1)

    def early_initialization(self, *args, **kwargs) -> None:
        """Layers learn batch, heads, dtype and device from their first update: nothing to do."""

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Offloaded layers prefetch themselves (tiercache.offload.processor)."""

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Offloaded layers write back only new tokens themselves (tiercache.offload.processor)."""

    # -- whole-cache operations ----------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """transformers 5.x: ``crop(-n)`` removes the last ``n`` tokens (every token when ``n`` is more
        than held); ``crop(0)`` trims sliding layers after a rollback; a positive value is refused."""
        x = tokens_to_remove
        if not isinstance(x, int) or isinstance(x, bool) or x > 0:
            raise CacheError(f"crop({x!r}): needs an int <= 0 (-n: remove the last n tokens; 0: trim sliding layers "
                             "after a rollback); a positive value is not supported (transformers 5.x refuses it too): "
                             "crop(x - cache.get_seq_length()) keeps the first x")
        # All or nothing: every layer validates first; sliding layers (the only ones that may refuse)
        # crop first; placeholders (KV sharing: reuse) ignore crop, as transformers' do.
        order = sorted(self._roles.stores, key=lambda i: not self.layers[i].is_sliding)
        self._each(lambda layer: layer.validate_crop(-x), order)
        self._each(lambda layer: layer.crop(-x), order)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each(lambda layer: layer.reorder(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._each(lambda layer: layer.select(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each(lambda layer: layer.repeat_interleave(repeats))

    def reset(self) -> None:
        """Empty every layer and free the shared buffers (workspace, prefetch slots): ``nbytes()`` is {} after
        (but for the conv / recurrent states of hybrid models, zeroed in place as transformers does)."""
        self._each(lambda layer: layer.reset())
        self._shared.close()  # re-created on demand

    def release_transients(self) -> None:
        """Free the buffers only a cache in use needs, keeping every token: each layer's device
        copy (the layer protocol's ``evict`` hook: an offloaded layer's mirror) and the shared
        buffers (dequantization workspace, prefetch slots). They are made again on the next use,
        which gives the same K/V. For a cache set aside (a stored conversation): it then holds,
        and ``nbytes()`` / ``tier_nbytes()`` report, only its own state."""
        self._each(lambda layer: layer.evict())
        self._shared.close()

    def activate_past_recording(self) -> None:
        self._each(lambda layer: layer.set_recording(True), self._roles.stores)

    def is_recording_past(self, layer_idx: int) -> bool:
        return self._layer(layer_idx).record_past and layer_idx not in self._roles

    def close(self) -> None:
        """Release every buffer and file now (also done when the cache is garbage-collected). The cache
        is then empty and may be used again, as after ``reset`` (it allocates anew)."""
        self._each(lambda layer: layer.close())
        self._shared.close()

    # -- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        """Bytes held now, per place (``cpu``, ``cuda:0``, ``disk`` ...)."""
        return accounting.per_place(self.layers, self._shared)

    def tier_nbytes(self) -> dict[str, int]:
        """Bytes held now, per tier (``device``, ``host``, ``disk``): host-tier bytes apart from
        compute-device bytes even on a CPU-only machine (the shared buffers are device bytes)."""
        return accounting.per_tier(self.layers, self._shared)

    def shared_nbytes(self) -> dict[str, int]:
        """The part of ``nbytes()`` in buffers shared by all layers, per place: the dequantization
        workspace (one layer at full precision) and the offload prefetch slots (prefetch + 1
        layers). They do not grow with the number of layers; the rest is the per-layer state."""
        return self._shared.nbytes()

    def workspace_nbytes(self) -> dict[str, int]:
        """The dequantization workspace's part of ``shared_nbytes()``, per place (the rest: prefetch slots)."""
        return self._shared.workspace_nbytes()

    def offload_stats(self) -> dict[str, int]:
        """The offload counters so far (``tiercache.offload.prefetch``); zeros without offload."""
        return self._shared.prefetcher.stats()

    # -- lifecycle (tiercache.lifecycle) --------------------------------------------------------
    def state_dict(self) -> dict:
        """Every layer's state (``layers.{i}.`` prefixes): tensors left where they live, no copies."""
        return {f"layers.{i}.{k}": v for i, layer in enumerate(self.layers) for k, v in layer.state_dict().items()}

    def fork(self) -> "TieredCache":
        """An independent copy: a cache built by the chain builder from the same layer policies,
        loaded from this one's state (tensors copied onto its own tiers, disk files of its own,
        its own prefetcher; no device mirror carried over). Writing to one never shows in the other."""
        from tiercache.cache.fork import fork

        return fork(self)

    def __deepcopy__(self, memo) -> "TieredCache":
        return self.fork()

    def __copy__(self) -> "TieredCache":
        """A shallow copy would share buffers, files and a prefetcher: ``copy.copy`` forks too."""
        return self.fork()

    def retier(self, policy) -> None:
        """Move this cache to ``policy`` (a Policy, YAML path or dict) in place, layer by layer."""
        from tiercache.cache.retier import retier

        retier(self, policy)

    def save(self, path, token_ids=None) -> None:
        """Write the cache as held to one file (``tiercache.lifecycle.persist``), atomically."""
        from tiercache.lifecycle.persist import save

        save(self, path, token_ids)

    @classmethod
    def load(cls, path, model_config, *, policy=None, device=None, offload_path=None, max_bytes=None):
        """A save for this model (``tiercache.lifecycle.persist``); ``policy=`` re-tiers it on the way in,
        ``device=`` the compute device, ``offload_path=`` / ``max_bytes=``: ``lifecycle.bounds``."""
        from tiercache.cache import retier
        from tiercache.lifecycle import persist

        return retier.retiered(persist.load(cls, path, spec_of(model_config), model_type_of(model_config), device,
                                            offload_path=offload_path, max_bytes=max_bytes), policy)

    def shared_buffers(self) -> list[torch.Tensor]:
        """The tensors behind ``shared_nbytes()`` (e.g. for ``tiercache.lifecycle.AllocationMeter``)."""
        return self._shared.buffers()

    def __repr__(self) -> str:
        seen = self.get_seq_length() if self._roles.kv_layers else "-"
        return f"TieredCache(policy={self.policy.name!r}, layers={len(self.layers)}, seen={seen})"

    # -- internals -------------------------------------------------------------------------------
    def _layer(self, layer_idx: int) -> KVLayer:
        check_layer_index(layer_idx, len(self.layers), self.model.name)
        return self.layers[layer_idx]

    def _attention_layer(self, layer_idx: int, what: str) -> KVLayer:
        """The layer that answers ``what`` for ``layer_idx`` (a placeholder 0, or a layer 0 without
        attention: the first that stores K/V, as transformers answers)."""
        self._layer(layer_idx)
        return self.layers[self._roles.answering(layer_idx, what)]

    def _stateful(self, layer_idx: int, what: str):
        """Layer ``layer_idx``, a ``StateLayer`` with a conv / recurrent state, else ``CacheError``."""
        layer = self._layer(layer_idx)
        self._roles.stateful(layer_idx, what)
        return layer

    def _on(self, i: int, op):
        """``op(layers[i])``; its CacheError names the layer index."""
        try:
            return op(self.layers[i])
        except CacheError as e:
            raise CacheError(f"layer {i}: {e}") from e

    def _each(self, op, order=None) -> None:
        """``op(layer)`` on every layer (or those of ``order``, in that order), one after the other."""
        for i in range(len(self.layers)) if order is None else order:
            self._on(i, op)


class CrossAttentionCache(TieredCache):
    """The cross-attention half of a ``TieredEncoderDecoderCache``: its layers follow the policy's
    ``cross_attention`` section (``tiercache.planner.cross_attention``); it is saved only with its pair."""

    @classmethod
    def layer_policies(cls, policy: Policy, model: ModelSpec) -> list:
        return cross_layer_policies(policy, model)

    def save(self, path, token_ids=None) -> None:
        raise CacheError("save: a cross-attention half is saved with its pair: save the TieredEncoderDecoderCache")


class TieredEncoderDecoderCache(EncoderDecoderPair):
    """transformers' ``EncoderDecoderCache`` over two TieredCaches (``TieredCache.for_encoder_decoder``):
    what it does is ``tiercache.cache.encoder_decoder``'s; here, the classes of its halves."""

    halves = (TieredCache, CrossAttentionCache)
