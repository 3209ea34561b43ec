"""Bytes one layer of a TieredCache holds, predicted from its LayerPolicy (no tensors made).

Interface
    layer_footprint(lp, model, batch, tokens) -> Footprint
        what layer ``lp`` holds once it has seen ``tokens`` tokens, per tier
        (``device`` | ``host`` | ``disk``), and for a quantized layer the tokens one decode step
        returns (what it needs of the shared workspace).
    mirror_bytes(footprints, prefetch) -> int
        device bytes of the offload prefetcher's mirror buffers, shared by all layers.
    workspace_bytes(footprints, model, batch) -> int
        device bytes of the dequantization workspace the quantized layers share (``chain.Shared``).

The formulas are the layers' own allocation rules, called rather than restated, so they predict
``nbytes()`` (allocated, not logical bytes) rather than ``tokens * bytes per token``: the store's
kind and geometry come from the layer's chain spec (``tiercache.planner.chainspec``, what the chain
builder builds), capacities from ``layers/capacity.py``, the packed row layout from
``quantize/codec.py`` and the residual split from ``quantize/geometry.py``. They describe a cache in steady
decoding at ``tokens`` (a prefill, then single-token steps); right after a long prefill a
sliding buffer can be one slack smaller.
- ``full``: a buffer grown to ``grown_capacity(tokens)`` (whole CHUNKs of 256 tokens on a ladder
  of 2^k and 1.5 x 2^k chunks; a cache reserved for its context (chunked prefill) holds
  ``capacity_for(tokens)``, at most this);
- ``sliding``: ``window`` tokens plus ``min(window, CHUNK)`` slack, in CHUNKs (``sliding_capacity``);
- ``static``: ``max_length`` tokens, preallocated;
- ``quantize`` (``quantize/processor.py``, ``blocks.py``): the residual, exactly the
  ``r(tokens)`` full-precision tokens it holds (``quantize_split``: a function of the tokens seen
  alone, whatever the prefill and step sizes), on the compute device; a store of packed rows,
  one per block of ``group_size`` tokens (``STORE_CHUNK`` rows at a time), each row
  ``[codes | pad | scale | offset]`` with scale and offset in the model dtype: one per channel
  (``channel`` axis) or per run of channels of each token (``token`` axis). A sliding layer's
  store keeps ``ceil((window - 1) / group_size) + 1`` blocks; a static one ``max_length // G``.
  The quantized layers that dequantize every step (``packed_attention: false``, and the
  cross-attention half of an encoder-decoder) share one workspace (``chain.Shared.workspace``): the
  K/V a decode step returns for the layer that returns the most (``tokens``; a sliding layer
  ``min(tokens, window)``), in whole CHUNKs of tokens. A ``packed_attention`` layer holds none: its
  decode steps read the codes and its prefill returns fresh tensors (transient, like activations);
  only a step whose attention is not SDPA (eager attention: the ``PackedKV`` fallback) reserves the
  workspace, which this plan does not count. Attention sinks (``sink_tokens = N``, full-attention
  layers): the first ``min(tokens, N)`` tokens held exactly beside the residual, which then
  follows ``r(tokens - N)``.
- KV sharing (``ModelSpec.kv_sharing``): a ``reuse`` layer never updates, so it holds nothing; a
  ``store`` layer's quantized K/V are returned in fresh tensors, not in the shared workspace.
- per-layer shapes: every formula takes the layer's ``(kv_heads, key_dim, value_dim)``
  (``ModelSpec.kv_shape``).
- ``offload`` (``offload/processor.py``): the store lives on the host or disk tier; the shared
  prefetcher keeps ``min(prefetch + 1, offloaded layers)`` device slots, each holding one
  layer's mirror, of ``offload/mirror.py``'s ``steady_capacity`` tokens or rows (the rule the
  mirror allocates by); with layers of different sizes the plan counts the largest ones (an
  upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.planner.chainspec import spec_for
from tiercache.layers.capacity import capacity_for
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import LayerPolicy, QuantizePolicy
from tiercache.offload.mirror import steady_capacity
from tiercache.quantize.codec import CodecSpec
from tiercache.quantize.geometry import flush_rows, flush_split

TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class Footprint:
    """One layer's predicted bytes: ``held[tier]``; ``mirrored`` is what a device mirror must hold."""

    held: dict = field(default_factory=dict)
    tokens: int = 0  # tokens the layer keeps (after its window)
    mirrored: int = 0  # bytes of the offloaded part (what the prefetcher copies to the device)
    workspace: int = 0  # bytes of the shared workspace a quantized layer's decode step needs; 0 otherwise

    def total(self) -> int:
        return sum(self.held.values())


def kept_tokens(lp: LayerPolicy, tokens: int) -> int:
    """Tokens a layer keeps after seeing ``tokens``: all of them, or the last ``window - 1``."""
    if spec_for(lp).store.kind == "sliding":
        return min(tokens, lp.window - 1)
    return tokens


def storage_capacity(lp: LayerPolicy, appended: int) -> int:
    """Capacity the store of ``lp`` allocates after ``appended`` one at a time: tokens, or rows
    (blocks) for a quantized layer (the chain spec's store, ``StoreSpec.capacity``)."""
    return spec_for(lp).store.capacity(appended)


def _fp_bytes(model: ModelSpec, index: int, batch: int, tokens: int) -> int:
    """Full-precision K and V bytes of ``tokens`` tokens of layer ``index``."""
    heads, key_dim, value_dim = model.kv_shape(index)
    return batch * heads * tokens * (key_dim + value_dim) * model.dtype_bytes


def row_bytes(q: QuantizePolicy, head_dim: int, which: str, dtype_bytes: int) -> int:
    """Bytes of one packed block row of ``"keys"`` / ``"values"`` (``quantize/codec.py``: codes, pad,
    scale [, offset])."""
    return CodecSpec.of(q).row_bytes(head_dim, which, dtype_bytes)


def quantized_bytes(q: QuantizePolicy, model: ModelSpec, batch: int, tokens: int, index: int = 0) -> int:
    """Packed K and V of ``tokens`` tokens (whole blocks) of layer ``index``, metadata included, no spare rows."""
    rows = batch * model.kv_shape(index)[0] * (tokens // q.group_size)
    return rows * _block_bytes(q, model, index)


def _block_bytes(q: QuantizePolicy, model: ModelSpec, index: int) -> int:
    """One block of K plus one of V of layer ``index``, for one batch row and head."""
    _, key_dim, value_dim = model.kv_shape(index)
    size = model.dtype_bytes
    return row_bytes(q, key_dim, "keys", size) + row_bytes(q, value_dim, "values", size)


def quantize_split(q: QuantizePolicy, seen: int) -> tuple[int, int]:
    """(packed tokens, residual tokens) after ``seen`` tokens went through a Quantize layer.

    KIVI: the residual fills up to ``residual_length`` (at least one block), then its whole
    blocks are packed (``quantize/geometry.py``: ``flush_split``, Quantize's own rule), so it
    holds fewer than ``max(residual_length, group_size)`` tokens, and how many depends on ``seen`` alone.
    """
    packed = flush_split(0, seen, q.residual_length, q.group_size)
    return packed, seen - packed


def layer_footprint(lp: LayerPolicy, model: ModelSpec, batch: int, tokens: int) -> Footprint:
    if model.kv_sharing(lp.index) == "reuse" or not lp.attends:  # reuses another layer's K/V, or holds none
        return Footprint({}, 0)  # (a hybrid model's conv / recurrent states: tiercache.planner.states)
    spec = spec_for(lp)  # what the chain builder builds: the store's kind and geometry
    st, sliding = spec.store, spec.store.kind == "sliding"
    kept = kept_tokens(lp, tokens)
    cold = "host" if lp.offload is None or lp.offload.device == "cpu" else "disk"
    i = lp.index
    if spec.quantize is None:
        cap = st.capacity(tokens)
        fp = _fp_bytes(model, i, batch, cap)
        if lp.offload is None:
            return Footprint({"device": fp}, kept)
        rows = batch * model.kv_shape(i)[0]  # one row (batch 1, one KV head): fetched with room (mirror.plan)
        floor = cap if st.kind == "static" else 0
        return Footprint({cold: fp}, kept, _fp_bytes(model, i, batch, steady_capacity(cap, kept, rows, floor)))
    q = lp.quantize
    sinks = min(tokens, spec.quantize.sinks)  # exact, on the device
    packed, residual = quantize_split(q, tokens - sinks)
    residual += sinks
    blocks = packed // q.group_size
    # the store of packed rows, one per block, appended a flush (``flush_rows``) at a time
    rows = st.capacity(blocks, step=flush_rows(q.residual_length, q.group_size))
    block = batch * model.kv_shape(i)[0] * _block_bytes(q, model, i)
    store = rows * block
    kept_rows = min(blocks, st.window - 1) if sliding else blocks
    held = {"device": _fp_bytes(model, i, batch, residual)}
    # the K/V a decode step returns, in the shared workspace (a "store" layer returns fresh tensors; a
    # packed-attention layer returns the codes, and fresh tensors for its prefill: none held)
    returned = min(tokens, lp.window) if sliding else tokens
    packed = spec.quantize.packed_attention and not spec.cross  # what the chain builder gives the layer
    shares = returned and not spec.owned_outputs and not packed
    work = _fp_bytes(model, i, batch, capacity_for(returned)) if shares else 0
    if lp.offload is None:
        held["device"] += store
        return Footprint(held, min(kept, kept_rows * q.group_size + residual), 0, work)
    held[cold] = store
    floor = rows if st.kind == "static" else 0
    mirror = block * steady_capacity(rows, kept_rows, batch * model.kv_shape(i)[0], floor) if blocks else 0
    return Footprint(held, min(kept, kept_rows * q.group_size + residual), mirror, work)


def workspace_bytes(footprints: list[Footprint], model: ModelSpec, batch: int) -> int:
    """The shared dequantization workspace: the largest decode step's K and V, in whole CHUNKs
    of tokens (``chain.Shared.workspace``); 0 without quantized layers."""
    return max((f.workspace for f in footprints), default=0)


def mirror_bytes(footprints: list[Footprint], prefetch: int) -> int:
    """Device slots of the prefetcher: ``prefetch + 1`` mirrors in flight at once.

    Exact when the offloaded layers are alike; when their sizes differ (overrides), the slots'
    sizes depend on the fetch schedule, and this is the upper bound: the largest ones together.
    """
    sizes = sorted((f.mirrored for f in footprints if f.mirrored), reverse=True)
    return sum(sizes[: prefetch + 1])
