"""Build one processor chain per model layer: ``build(spec_for(lp), shared)``.

    build(spec: ChainSpec, shared=None) -> KVLayer      the only constructor of chains
    build_layer(lp, shared, padded=False)               ``build(spec_for(lp, padded), shared)``
    build_layers(layer_policies, compiled=False) -> (layers, Shared)
                                                        one cache's chains and what they share
    make_storage(window, max_length, tier, chunk, padded)   one storage layer

``compiled``: the cache is a ``CompileableCache`` (one graph per decode step): every layer must
be resident ``static`` attention storage (``check_compiled``, else ``PolicyError`` naming the
layer), built padded; a quantized one is a ``StaticQuantized`` (``tiercache.quantize.static_layer``).
Otherwise the static layers of a cache are padded only when every layer is full-precision
resident static storage (``compileable``): then the cache is compileable as a whole too.

The chain's shape comes from its ``ChainSpec`` (``tiercache.planner.chainspec``, derived purely from the
``LayerPolicy``), from the inside out:

    quantize off, offload off:   storage                       (full | static | sliding)
    offload only:                Offload(storage on host/disk)
    quantize (+ offload):        Quantize(store, Codec)        the store of packed blocks, sized
                                                               by the spec (rows, not tokens),
                                                               offloaded when asked

Hybrid and recurrent models: a layer that keeps a conv / recurrent state (``lp.states``) or
no attention K/V at all (``not lp.attends``) is a ``StateLayer`` (``tiercache.cache.state_layer``):
transformers' own state, exact, around the layer's attention chain when it has one.

Attention layers with a side state (``indexed_attention``: indexer keys; DeepSeek-V4's
compressed layers: a compressor state) are an ``IndexedLayer`` / ``CompressedLayer`` around the
layer's chain (``tiercache.cache.indexed_layer``, ``tiercache.cache.compressed_layer``).

Cross-attention layers (``layer_type == "cross_attention"``, encoder-decoder models) get
``CrossAttention(...)`` around the chain: transformers reads them back through ``.keys`` /
``.values``.

Quantize sits *outside* Offload so that what is kept on the host and crosses the bus is the
packed blocks, and the residual window stays on the compute device. ``Shared`` carries what
the layers of one cache share: the offload prefetcher (side stream, device buffers) and the
dequantization workspace of the quantized layers (``Shared.workspace``).

KV sharing (Gemma 3n / Gemma 4): a layer whose K/V later layers read (``kv_sharing ==
"store"``) must return tensors that outlive other layers' updates, so it gets no shared
workspace (Quantize returns fresh tensors) and an offloaded one returns copies of its mirror
(the prefetcher's slots are reused by the next layers).
"""

from __future__ import annotations

import math

import torch

from tiercache.errors import PolicyError
from tiercache.planner.chainspec import ChainSpec, spec_for
from tiercache.layers.base import KVLayer
from tiercache.layers.buffer import CHUNK, capacity_for
from tiercache.layers.cross import CrossAttention
from tiercache.layers.full import FullLayer
from tiercache.layers.sliding import SlidingLayer
from tiercache.layers.static import StaticLayer
from tiercache.layers.tiers import by_place, summed
from tiercache.models.spec import INDEXED_TYPES, SIDE_STATE_TYPES
from tiercache.offload.processor import Prefetcher, offloaded
from tiercache.policy.schema import LayerPolicy
from tiercache.quantize.blocks import Codec
from tiercache.quantize.processor import Quantize
from tiercache.quantize.static_layer import StaticQuantized, supported


def make_storage(window: int | None = None, max_length: int | None = None, tier=None, chunk: int = CHUNK,
                 padded: bool = False, geometric: bool = False) -> KVLayer:
    """``sliding`` when a window is given, else ``static`` when a max_length is, else ``full``.

    ``chunk``: tokens of capacity a growable buffer adds at a time (a quantized layer's store
    holds one packed block per "token" and grows ``STORE_CHUNK`` rows at a time, not 256:
    its ``StoreSpec``). ``geometric``: a full buffer regrows on ``capacity.grown_capacity``'s
    ladder (full precision; a quantized store grows exactly). ``padded``: a
    static layer returns all ``max_length`` slots (only in a cache that is compileable as a
    whole, see ``tiercache.layers.static``).
    """
    if window is not None:
        return SlidingLayer(window, tier, chunk)
    if max_length is not None:
        return StaticLayer(max_length, tier, padded=padded)
    return FullLayer(tier, chunk, geometric)


class Shared:
    """Objects shared by the layers of one cache; created lazily, closed with the cache.

    ``workspace(shapes, dtype, device)``: tensors of ``shapes`` (each ``[..., S, D]``), laid one
    after the other in one reusable buffer per (dtype, device). Quantize returns its dequantized
    K/V in them, so a decode step allocates nothing; they are valid until the next call (the next
    update on the cache), which overwrites them. The buffer grows to the largest request so far,
    each shape counted with ``S`` rounded up to whole chunks (``capacity_for``), never shrinks,
    and is reported once by ``nbytes()`` under the device's place.
    """

    def __init__(self):
        self._prefetcher = None
        self._workspaces: dict[tuple, torch.Tensor] = {}  # (dtype, device, stream device) -> buffer

    @property
    def prefetcher(self):
        if self._prefetcher is None:
            self._prefetcher = Prefetcher()
        return self._prefetcher

    def workspace(self, shapes, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        need = [math.prod(s) for s in shapes]
        from tiercache import runtime  # one per device: the runtime tells devices apart (simulated ones too)

        key = (dtype, *runtime.device_key(device))
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < sum(need):  # rounded up, so this is rare: only then the chunks
            capacity = sum(math.prod(s[:-2]) * capacity_for(s[-2]) * s[-1] for s in shapes)
            if buf is None or buf.numel() < capacity:
                buf = self._workspaces[key] = None  # the old one is freed before the new is made
                buf = self._workspaces[key] = torch.empty(capacity, dtype=dtype, device=device)
        out, at = [], 0
        for shape, n in zip(shapes, need):
            out.append(buf.narrow(0, at, n).view(shape))
            at += n
        return out

    def buffers(self) -> list[torch.Tensor]:
        """The shared tensors held now (workspaces, prefetch slots): what a memory meter watches."""
        slots = [] if self._prefetcher is None else [s.data for s in self._prefetcher.slots if s.data is not None]
        return [*self._workspaces.values(), *slots]

    def workspace_nbytes(self) -> dict[str, int]:
        """Bytes of the dequantization workspaces, per place (part of ``nbytes()``)."""
        return by_place(self._workspaces.values())

    def nbytes(self) -> dict[str, int]:
        """Bytes of shared buffers (the prefetcher's device mirrors, the workspaces), per place."""
        return summed([self._prefetcher.nbytes() if self._prefetcher is not None else {}, self.workspace_nbytes()])

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._workspaces.clear()


def _not_compiled(lp: LayerPolicy) -> str | None:
    """Why layer ``lp`` cannot be in a cache whose decode step compiles to one graph, or None."""
    if not lp.attends or lp.states or lp.layer_type in SIDE_STATE_TYPES:
        return "a compileable cache holds attention K/V only (no recurrent or side state)"
    if lp.window is not None:
        return f"sliding window {lp.window}; a compileable cache supports full-attention layers only"
    if lp.storage != "static" or lp.max_length is None:
        return f"storage {lp.storage!r}; a compileable cache needs storage: static with max_length"
    if lp.offload is not None:
        return "offload; a compileable cache keeps every layer on the compute device (offload: null)"
    if lp.quantize is not None:
        why = supported(lp.quantize)
        return None if why is None else f"quantize {why} is not supported by the static quantized layer"
    return None


def compileable(lp: LayerPolicy) -> bool:
    """The layer is plain resident static storage (a cache of only those is compileable)."""
    return lp.quantize is None and _not_compiled(lp) is None


def check_compiled(lp: LayerPolicy) -> None:
    """``PolicyError`` unless ``lp`` can be a layer of a ``CompileableCache`` (module docstring)."""
    why = "a compileable cache holds no KV sharing" if lp.kv_sharing is not None else _not_compiled(lp)
    if why is not None:
        raise PolicyError(f"layer {lp.index} ({lp.layer_type}): {why}")


def build(spec: ChainSpec, shared: Shared | None = None) -> KVLayer:
    """The chain ``spec`` describes (module docstring). ``shared``: what the layers of one cache
    share; None builds a chain that shares nothing (a quantized layer returns fresh tensors, an
    offloaded one gets a prefetcher of its own)."""
    st = spec.store
    q = spec.quantize

    def storage(tier=None) -> KVLayer:
        return make_storage(st.window, st.max_length, tier, st.chunk, st.padded, st.geometric)

    if q is not None and st.padded:  # only in a compiled cache (check_compiled)
        layer = StaticQuantized(Codec(q.codec), q.residual_length, q.max_length)
    elif spec.offload is None:
        layer = storage()
    else:
        prefetcher = (shared if shared is not None else Shared()).prefetcher
        layer = offloaded(storage, spec.offload, prefetcher, spec.index,
                          owned_outputs=spec.owned_outputs and spec.quantize is None)
    if q is not None and not st.padded:
        layer = Quantize(layer, Codec(q.codec), q.residual_length, q.sink_tokens, window=q.window,
                         max_length=q.max_length, shared=None if spec.owned_outputs else shared,
                         packed_attention=q.packed_attention and not spec.cross)
    if spec.cross:  # read back every step through .keys / .values
        layer = CrossAttention(layer, fresh_reads=spec.quantize is not None)
    layer.policy = spec.policy  # each chain knows the LayerPolicy it was built from
    return layer


def build_layer(lp: LayerPolicy, shared: Shared, padded: bool = False) -> KVLayer:
    """``build(spec_for(lp, padded), shared)``; a ``StateLayer`` around it (or alone) for a layer with a
    conv / recurrent state or no attention (hybrid and recurrent models); an ``IndexedLayer`` /
    ``CompressedLayer`` around it for an attention layer with a side state (``tiercache.cache.side_state``)."""
    if lp.layer_type in SIDE_STATE_TYPES:
        return _side_state_layer(lp, build(spec_for(lp, padded), shared))
    if lp.attends and not lp.states:
        return build(spec_for(lp, padded), shared)
    from tiercache.cache.state_layer import StateLayer

    layer = StateLayer(lp.states, build(spec_for(lp, padded), shared) if lp.attends else None)
    layer.policy = lp
    return layer


def _side_state_layer(lp: LayerPolicy, attention: KVLayer) -> KVLayer:
    if lp.layer_type in INDEXED_TYPES:
        from tiercache.cache.indexed_layer import IndexedLayer

        layer = IndexedLayer(attention)
    else:
        from tiercache.cache.compressed_layer import CompressedLayer

        layer = CompressedLayer(attention, lp.layer_type, lp.window, lp.compress_rate)
    layer.policy = lp
    return layer


def build_layers(layer_policies: list[LayerPolicy], compiled: bool = False) -> tuple[list[KVLayer], Shared]:
    """Every layer's chain; ``compiled``: checked and built as the module docstring says."""
    if compiled:
        for lp in layer_policies:
            check_compiled(lp)
    shared = Shared()
    padded = compiled or (bool(layer_policies) and all(compileable(lp) for lp in layer_policies))
    return [build_layer(lp, shared, padded) for lp in layer_policies], shared
