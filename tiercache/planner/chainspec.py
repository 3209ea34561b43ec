"""What one layer's processor chain is, derived purely from its ``LayerPolicy`` (no torch, no tensors).

    spec_for(lp: LayerPolicy, padded=False) -> ChainSpec
        frozen and hashable; equal policies give equal specs. ``tiercache.cache.chain.build(spec,
        shared)`` makes the chain from it (the only constructor of chains) and the planner
        (``tiercache.planner.footprint``) reads the same geometry to predict its bytes.

    ChainSpec
        policy          the LayerPolicy it was derived from (the chain reports it as ``.policy``)
        index           the model layer
        store           StoreSpec: the innermost storage layer
        quantize        QuantizeSpec or None
        offload         the OffloadPolicy (tier, path, prefetch depth, pinning) or None: the
                        store lives on the host tier, behind ``Offload``
        owned_outputs   ``kv_sharing == "store"``: later layers read this layer's K/V, so it returns
                        tensors that outlive other layers' updates (no shared workspace, no mirror views)
        cross           a cross-attention layer (encoder-decoder): wrapped in ``CrossAttention``
    StoreSpec(kind, window, max_length, chunk, padded, geometric)
        ``kind`` full | static | sliding; ``window`` (sliding) and ``max_length`` (static) in the
        store's units: tokens, or packed blocks (rows) under Quantize; ``chunk``: capacity a
        growable store adds at a time; ``padded``: a static store returns all its slots (only
        in a cache that is compileable as a whole; under quantize, the layer is then a
        ``StaticQuantized``); ``geometric``: a full store regrows on
        ``grown_capacity``'s ladder (full precision; a quantized store grows exactly, a row
        at a time). ``capacity(appended, step)``: what it allocates (``layers/capacity.py``).
    QuantizeSpec(codec, residual_length, sink_tokens, window, max_length)
        ``codec`` the block format (``quantize/codec.CodecSpec``); ``window`` / ``max_length``
        in tokens; ``sinks`` the attention sinks kept exact (none on a sliding layer)

Geometry: a full-precision layer's store is the layer's own (``window`` tokens, ``max_length``
tokens, ``CHUNK``); a quantized layer's store holds one row per block of ``group_size`` tokens:
``store_window(window, G)`` rows for a sliding layer, ``static_rows(max_length, G)`` for a
static one, growing ``STORE_CHUNK`` rows at a time (``quantize/geometry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.layers.capacity import CHUNK, store_capacity
from tiercache.policy.schema import LayerPolicy, OffloadPolicy
from tiercache.quantize.codec import CodecSpec
from tiercache.quantize.geometry import STORE_CHUNK, kept_sinks, static_rows, store_window


@dataclass(frozen=True)
class StoreSpec:
    kind: str  # full | static | sliding
    window: int | None = None
    max_length: int | None = None
    chunk: int = CHUNK
    padded: bool = False
    geometric: bool = False  # a full buffer regrows on capacity.grown_capacity's ladder

    def capacity(self, appended: int, step: int = 1) -> int:
        """Capacity (tokens, or rows) after ``appended`` were appended ``step`` at a time (steady decoding)."""
        return store_capacity(self.kind, appended, self.window, self.max_length, self.chunk, step, self.geometric)


@dataclass(frozen=True)
class QuantizeSpec:
    codec: CodecSpec
    residual_length: int
    sink_tokens: int  # as configured
    window: int | None  # tokens
    max_length: int | None  # tokens
    packed_attention: bool = True  # decode steps attend over the codes (quantize/packed_kv.py)

    @property
    def sinks(self) -> int:
        return kept_sinks(self.sink_tokens, self.window)


@dataclass(frozen=True)
class ChainSpec:
    policy: LayerPolicy
    index: int
    store: StoreSpec
    quantize: QuantizeSpec | None
    offload: OffloadPolicy | None
    owned_outputs: bool
    cross: bool


def spec_for(lp: LayerPolicy, padded: bool = False) -> ChainSpec:
    window = lp.window
    max_length = lp.max_length if lp.storage == "static" else None
    padded = padded and lp.offload is None  # (an offloaded store is never padded)
    q = lp.quantize
    if q is None:
        kind = "sliding" if window is not None else ("static" if max_length is not None else "full")
        store = StoreSpec(kind, window, max_length if kind == "static" else None, CHUNK, padded, kind == "full")
        quantize = None
    else:
        g = q.group_size
        if window is not None:
            store = StoreSpec("sliding", store_window(window, g), None, STORE_CHUNK, padded)
        elif max_length is not None:
            store = StoreSpec("static", None, static_rows(max_length, g), STORE_CHUNK, padded)
        else:
            store = StoreSpec("full", None, None, STORE_CHUNK, padded)
        quantize = QuantizeSpec(CodecSpec.of(q), q.residual_length, q.sink_tokens, window, max_length,
                                q.packed_attention)
    return ChainSpec(lp, lp.index, store, quantize, lp.offload, lp.kv_sharing == "store",
                     lp.layer_type == "cross_attention")
