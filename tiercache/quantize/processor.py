"""``Quantize``: tokens beyond a full-precision residual are kept as packed blocks (KIVI-style).

    Quantize(inner, codec, residual_length, sink_tokens=0, window=None, max_length=None, shared=None,
             packed_attention=False)
        a ``Delegating`` layer around ``inner``, like ``Offload(inner)``; ``packed_attention`` (with ``shared``):
        a decode step returns ``PackedKV`` and attention reads the codes (``quantize/packed_kv.py``)

``inner`` is the *store* (full / sliding / static, possibly offloaded), built by the chain
builder from the chain spec's geometry (``tiercache.planner.chainspec``, ``quantize/geometry.py``): a
sliding layer's store covers ``store_window(window, G)`` blocks, a static one
``static_rows(max_length, G)``, a full one is unbounded (a mismatch is refused). Quantize
appends to it one "token" per block: a uint8 row ``[B, H, 1, row_bytes]`` for the keys and one
for the values (``tiercache.quantize.blocks``), so the store and an Offload around it only
ever hold and move compressed bytes. ``codec`` (``blocks.Codec``) is the block format; it makes
the two ``BlockCodec`` at the first update, when head dims and dtype are known. ``config`` is
the equivalent ``QuantizePolicy`` (what a state dict records). ``shared`` (a
``tiercache.cache.chain.Shared``) lends the dequantization workspace; without it every update
returns fresh tensors.

Residual (KIVI). The newest tokens stay in full precision on the compute device. The residual
fills up to ``R = residual_length`` tokens; when it reaches ``R`` (or ``G = group_size`` if
``R < G``), its whole blocks of ``G``, oldest first, are quantized *once*, in one call, and
appended: with ``G`` dividing ``R`` it is emptied, as in transformers' QuantizedCache. A block
is never re-quantized, so no error accumulates and quantization work per token does not grow
with history. An update of ``T`` tokens leaves exactly the state ``T`` one-token updates would,
so the split is a function of the tokens seen, ``n``, alone: the residual holds ``r(n)`` tokens,
    r(n) = n                              while n < F, where F = max(R, G)
    r(n) = F mod G + (n - F) mod P        after, where P = F - F mod G (the flush period),
so once ``F`` tokens were seen, ``R mod G <= r <= R - 1`` (``R >= G``; ``0 <= r <= G - 1`` when
``R < G``): the newest ``r`` tokens are exact and every older one is quantized. E.g. ``R = 128,
G = 64``: a 3000-token prompt packs 46 blocks and keeps 56; decoding then holds 0 to 127.
The residual is kept in exactly-sized tensors (``nbytes()`` is what is held): an update copies
at most ``max(R, G)`` tokens, bounded work, never the history. Crops move the phase (below).

Autograd: quantization has no useful gradient, so updates run under ``torch.no_grad()`` and
return tensors without history; the cache works the same inside or outside ``torch.no_grad()``.

Update. Refuses non-finite keys/values (``CacheError``, the layer unchanged): one NaN would
poison the scale of a whole group. The check reads the new tokens only (one max-abs per K and
V); on CUDA it is read without a host sync and surfaces at the layer's next use
(``quantize/finite.py``). Returns ``[B, H, S, D]``: the blocks stored before this
update dequantized in one vectorized pass straight into the output, then the residual and the
new tokens at full precision (no concatenation of the history). Without ``packed_attention``
the output lives in the cache's shared workspace (no allocation per step): it is valid until the
next update on the cache (a sliding layer's multi-token update longer than its window, and caches
built without ``shared``, get fresh tensors). With ``packed_attention`` a decode step returns
``PackedKV`` (the workspace is reserved only if that step falls back to dequantizing) and every
other update returns fresh tensors, so nothing of the context's size is held beside the cache. Tokens packed during this update are still in hand, so this
update attends over them exactly, as transformers' QuantizedCache does (a long prompt's own
attention is not perturbed); later updates see them dequantized. A step costs one pass over
the packed history plus work bounded by the residual.

Storage kinds
- full: the store grows by exactly the blocks of each flush, so its bytes are exactly the packed
  size (a regrow copies the packed history once per flush: a small fraction of the per-step
  dequantization).
- sliding (``window``): transformers' sliding contract exactly, like ``SlidingLayer`` (an update
  of ``T`` tokens returns the last ``window - 1 + T``); the store is a ``SlidingLayer`` of
  ``ceil((window - 1) / group_size) + 1`` blocks, enough to cover the window. ``set_recording``
  reaches the store.
- static (``max_length``): supported. The store is a ``StaticLayer`` preallocated for
  ``max_length // group_size`` blocks; an update past ``max_length`` raises ``CacheError``.
  Outputs have the dynamic length ``seq_length()`` (mask sizes as ``full``), so it is not
  CUDA-graph capturable (``is_compileable`` is False).

Cache ops act on blocks and residual alike. ``crop`` reaching into the blocks drops whole
blocks from the store and moves the kept head of the cut block back into the residual as its
dequantized values (what attention saw, less the ``key_gain``, which only packed tokens carry:
``BlockCodec.decode_plain``); those tokens are quantized once more when
they leave the residual again (the only case a value is quantized twice). After a crop the
residual may hold fewer than ``r(n)`` tokens; the flush rule above applies from there. A crop
of ``seq_length()`` tokens or more empties the layer (transformers' ``DynamicLayer``), even a
sliding one whose window dropped blocks (the empty result is exact); ``keys`` / ``values``
(``kv``) dequantize the whole history into fresh tensors on each read.

Attention sinks (``sink_tokens = N``, full-attention layers only: a sliding window slides them
out): the first ``N`` tokens seen are kept apart in full precision, never quantized, and returned
first, bit-identical; the residual rule above runs on the tokens after them (``r(n - N)``). A crop
reaching into them removes the newest of them; the next tokens refill them.
"""

from __future__ import annotations

import dataclasses

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer
from tiercache.layers.delegating import Delegating
from tiercache.layers.spec import KVSpec
from tiercache.layers.tiers import summed
from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import crop as quantize_crop, state as quantize_state
from tiercache.quantize.blocks import BlockCodec, Codec
from tiercache.quantize.finite import FiniteGuard, describe
from tiercache.quantize.geometry import flush_split, kept_sinks, static_rows, store_window
from tiercache.quantize.packed_kv import decode_pair
from tiercache.quantize.residual import Residual

__all__ = ["Quantize", "flush_split", "PACKED_QUERIES"]

PACKED_QUERIES = 16  # an update of at most this many tokens is a decode step (packed attention)


class Quantize(Delegating):
    def __init__(self, inner: KVLayer, codec: Codec, residual_length: int, sink_tokens: int = 0,
                 window: int | None = None, max_length: int | None = None, shared=None, packed_attention: bool = False):
        self.codec = codec
        self.g, self.r, self.sink_tokens = codec.group_size, residual_length, sink_tokens
        self.window, self.limit = window, max_length
        self.shared = shared
        if window is not None:
            if not isinstance(window, int) or window < 1:
                raise CacheError(f"sliding window must be an int >= 1, got {window!r}")
            self.store_window = store_window(window, self.g)  # blocks; it keeps one less
            rows = self.store_window
        elif max_length is not None:
            if not isinstance(max_length, int) or max_length < 1:
                raise CacheError(f"static storage needs max_length >= 1, got {max_length!r}")
            rows = static_rows(max_length, self.g)
        else:
            rows = -1
        if inner.max_length() != rows:
            raise CacheError(f"quantize: the store must hold {rows} blocks (-1: unbounded) for window={window}, "
                             f"max_length={max_length}, group_size={self.g}; got one of {inner.max_length()}")
        super().__init__(inner)  # the store: one packed block per "token"
        self.is_sliding = window is not None
        self.residual = Residual()  # [B, H, r, D], r < max(R, G)
        self.sinks = Residual()  # [B, H, s, D], s <= N: the first tokens, exact
        self.n_sinks = kept_sinks(sink_tokens, window)
        self.spec: KVSpec | None = None
        self.codecs: tuple[BlockCodec, BlockCodec] | None = None
        self.seen = 0  # tokens seen (positions), including any slid out of a window
        self.recorded = 0  # sliding: tokens updated while recording since the last crop (kept past the window)
        self.stored = False  # the store has had an update (knows batch, dtype, device)
        self.finite = FiniteGuard()  # refuses non-finite updates (quantize/finite.py)
        self.packed_attention = packed_attention and shared is not None  # decode steps return PackedKV

    @property
    def store(self) -> KVLayer:
        """The wrapped layer (``inner``): it holds the packed blocks, one per "token"."""
        return self.inner

    # -- what it changes (prefetch, evict and ``recording`` are the store's: ``Delegating``) -------
    @torch.no_grad()
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec or KVSpec.read(key, value)  # layout and static room: checked once (layers/validate.py)
        t = key.shape[2]
        self.finite.check(key, value, self.seen, lambda: describe(key, value, self.seen, self.g))  # no host sync on CUDA
        sink = min(self.n_sinks - len(self.sinks), t)  # the first tokens seen stay exact
        full = key, value
        if sink:  # (no op otherwise: a decode step issues as few as it can)
            key, value, t = key.narrow(2, sink, t - sink), value.narrow(2, sink, t - sink), t - sink
        codecs = self.codecs or self._codecs(spec)
        held = len(self.residual)
        flush = flush_split(held, t, self.r, self.g)  # oldest tokens to pack now
        taken = min(flush, held)
        if flush:
            old_k, old_v = self.residual.view(0, taken) if taken else (key.narrow(2, 0, 0), value.narrow(2, 0, 0))
            if flush > held:  # the block runs into the new tokens (bounded by this update)
                old_k = torch.cat([old_k, key.narrow(2, 0, flush - held)], dim=2)
                old_v = torch.cat([old_v, value.narrow(2, 0, flush - held)], dim=2)
            blocks = self.store.append(codecs[0].encode(old_k), codecs[1].encode(old_v))
            self.stored = True
        else:
            blocks = self._held_blocks()
        # bound to this shape only once the store accepted: a refused first update leaves the layer as new
        self.codecs, self.spec = codecs, spec
        if sink:
            self.sinks.replace(0, full[0].narrow(2, 0, sink), full[1].narrow(2, 0, sink))
        if blocks is not None:
            n = self.store.seq_length() if self.limit is not None else blocks[0].shape[2]
            n -= flush // self.g  # blocks packed just now are still in hand at full precision
            if n < blocks[0].shape[2]:
                blocks = blocks[0].narrow(2, 0, n), blocks[1].narrow(2, 0, n)
        visible = None if self.window is None else self.window - 1 + t
        if self.packed_attention and blocks is not None and t + sink <= PACKED_QUERIES:
            out = decode_pair(self, blocks, (key, value), visible)  # a decode step: PackedKV, attention reads the codes
        else:  # a packed layer's other updates (prefill, long steps) get fresh tensors: the workspace is the fallback's
            out = self._assemble(blocks, (key, value), visible, workspace=not self.packed_attention)
        rest = flush - taken  # new tokens that stay in the residual start here
        if rest:
            key, value = key.narrow(2, rest, t - rest), value.narrow(2, rest, t - rest)
        self.residual.replace(taken, key, value)
        self.seen += t + sink
        if self.window is not None and self.recording:
            self.recorded += t + sink
        return out

    def layout(self):
        return self.spec

    def seq_length(self) -> int:
        return self.seen

    mask_sizes = KVLayer.mask_sizes  # in tokens, from seq_length (the store's counts blocks)

    def reserve(self, tokens: int) -> None:
        """The store grows by exactly the blocks of each flush (its bytes are the packed size)."""

    def max_length(self) -> int:
        return self.window if self.window is not None else (self.limit if self.limit is not None else -1)

    validate_crop = quantize_crop.validate  # (tiercache.quantize.crop)
    crop = quantize_crop.crop

    def gather(self, index: torch.Tensor) -> None:
        """Batch rows ``index`` of the packed blocks, then of the residual and sinks."""
        if self.spec is None:
            return
        if self.stored:
            self.store.gather(index)
        self.residual.gather(index.to(self.spec.device))
        self.sinks.gather(index.to(self.spec.device))
        self.spec = self.spec.with_batch(index.numel())

    def reset(self) -> None:
        self.store.reset()
        self._empty()

    def close(self) -> None:
        """Release everything; the layer is empty afterwards (as after ``reset``)."""
        self.store.close()
        for codec in self.codecs or ():
            codec.forget()
        self._empty()

    def _empty(self) -> None:
        self.residual.clear()
        self.finite.reset()
        self.sinks.clear()
        self.spec, self.codecs, self.seen, self.stored, self.recorded = None, None, 0, False, 0

    @torch.no_grad()
    def kv(self, fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole history dequantized into fresh tensors ``[B, H, S, D]`` on the compute device,
        never the workspace: callers may keep them (a sliding layer: the tokens a ``SlidingLayer``
        keeps, the last ``window - 1`` plus those recorded since the last crop). The store is read
        with the same ``fetch``; only with it do the codecs keep views of the rows."""
        self.finite.surface()  # a landed non-finite flag refuses
        if self.spec is None:
            return None
        k, v = self._assemble(self._held_blocks(fetch), None, None, workspace=False, remember=fetch)  # [B, H, S, D]
        if self.window is not None:
            keep = min(self.window - 1, self.seen - self.recorded) + self.recorded
            if k.shape[2] > keep:
                k, v = k[:, :, k.shape[2] - keep :], v[:, :, k.shape[2] - keep :]
        return (k, v) if k.shape[2] else None

    def tier_nbytes(self) -> dict[str, int]:
        exact = [{"device": n} for n in (*self.residual.nbytes().values(), *self.sinks.nbytes().values())]
        return summed([self.store.tier_nbytes(), *exact])  # the residual and sinks: on the compute device

    # -- lifecycle (tiercache.quantize.state) ------------------------------------------
    state_dict = quantize_state.state_dict
    load_state_dict = quantize_state.load_state_dict
    export = quantize_state.export
    ingest = quantize_state.ingest

    @property
    def config(self) -> QuantizePolicy:
        """The policy this layer quantizes by (its saved ``config``): the block format, the residual, the sinks."""
        return dataclasses.replace(self.codec.spec.policy(self.r, self.sink_tokens),
                                   packed_attention=self.packed_attention)

    def can_adopt(self, other: KVLayer) -> bool:
        """The same block format (codec) and residual rule: ``other``'s packed rows and residual are
        what this layer would hold had it been fed the same tokens."""
        return (isinstance(other, Quantize) and other.codec == self.codec and other.r == self.r
                and other.n_sinks == self.n_sinks)

    adopt = quantize_state.adopt  # the state as held (same block format): packed blocks move, not re-quantized

    def nbytes(self) -> dict[str, int]:
        return summed([self.store.nbytes(), self.residual.nbytes(), self.sinks.nbytes()])

    def set_recording(self, on: bool) -> None:
        self.store.set_recording(on)
        if not on:
            self.recorded = 0

    def _codecs(self, spec: KVSpec) -> tuple[BlockCodec, BlockCodec]:
        return self.codec.for_kv(spec.key_dim, spec.value_dim, spec.dtype)

    def _held_blocks(self, fetch: bool = True):
        return self.store.kv(fetch) if self.stored else None  # [B, H, N, row] each, or None

    def _visible(self, blocks, held: int, fresh: int, visible: int | None):
        """(blocks, n, skip): the blocks that hold visible tokens, their count, and the leading
        tokens of the first not returned (sliding: the window's tail only)."""
        g, n, skip = self.g, 0 if blocks is None else blocks[0].shape[2], 0
        if visible is not None and n * g + held + fresh > visible:
            skip = n * g + held + fresh - visible
            first = min(skip // g, n)
            blocks = None if blocks is None else (blocks[0][:, :, first:], blocks[1][:, :, first:])
            n -= first
            skip -= first * g
        return blocks, n, skip

    def _assemble(self, blocks, new, visible: int | None, workspace: bool = True, remember: bool = True,
                  residual=False):
        """Dequantized blocks, the residual (``residual``: these tensors, not the held ones), then
        ``new`` tokens (the last ``visible`` of them): one ``[B, H, S, D]`` per K and V, in the
        shared workspace when there is one (``remember``: let the codecs keep views of the rows
        for the next step)."""
        g, s = self.g, self.spec
        if residual is False:
            residual = self.residual.view() if len(self.residual) else None
        held, fresh = (0 if residual is None else residual[0].shape[2]), (0 if new is None else new[0].shape[2])
        blocks, n, skip = self._visible(blocks, held, fresh, visible)
        sinks = len(self.sinks)  # 0 on sliding layers, so ``skip`` never reaches them
        size = sinks + n * g + held + fresh - skip
        shapes = [(s.batch, s.heads, size, s.key_dim), (s.batch, s.heads, size, s.value_dim)]  # [B, H, S, D]
        if workspace and self.shared is not None and (self.window is None or size <= self.window):
            outs = self.shared.workspace(shapes, s.dtype, s.device)
        else:
            outs = [torch.empty(shape, dtype=s.dtype, device=s.device) for shape in shapes]
        res = residual
        for i, out in enumerate(outs):
            at, lo = sinks, skip
            if sinks:
                out.narrow(2, 0, sinks).copy_(self.sinks.view()[i])
            if n:
                rows = blocks[i] if blocks[i].device == s.device else blocks[i].to(s.device, non_blocking=True)
                if lo:  # the oldest block is only partly visible: decode it aside
                    part = torch.empty((s.batch, s.heads, g, shapes[i][3]), dtype=s.dtype, device=s.device)
                    self.codecs[i].decode(rows.narrow(2, 0, 1), part, remember)
                    out.narrow(2, 0, g - lo).copy_(part.narrow(2, lo, g - lo))
                    rows, at, lo = rows.narrow(2, 1, n - 1), g - lo, 0
                if rows.shape[2]:
                    self.codecs[i].decode(rows, out.narrow(2, at, rows.shape[2] * g), remember)
                    at += rows.shape[2] * g
            for src, count in ((res, held), (new, fresh)):
                if count > lo:
                    out.narrow(2, at, count - lo).copy_(src[i] if lo == 0 else src[i].narrow(2, lo, count - lo))
                    at += count - lo
                lo = max(lo - count, 0)
        return outs[0], outs[1]

