"""``Quantize``: tokens beyond a full-precision residual are kept as packed blocks (KIVI-style).

    Quantize(make_store, config: QuantizePolicy, window=None, max_length=None)   a KVLayer

``make_store(window, max_length, chunk)`` builds the *inner store* (full / sliding / static,
possibly offloaded); Quantize appends to it one "token" per block: a uint8 row ``[B, H, 1,
row_bytes]`` for the keys and one for the values (``tiercache.processors.blocks``), so the store
and an Offload around it only ever hold and move compressed bytes.

Residual. The newest tokens stay in full precision on the compute device: at least
``residual_length`` of them, fewer than ``residual_length + group_size``. When an update would
pass that, the oldest ``group_size`` tokens (as many whole blocks as needed) are quantized
*once*, in one call, and appended; a block is never re-quantized, so no error accumulates and
quantization work per token does not grow with history.

Update. Returns ``[B, H, S, D]`` in a fresh tensor: the blocks stored before this update
dequantized in one vectorized op straight into its front, then the residual and the new tokens
at full precision (no concatenation of the history). Tokens packed during this update are
still in hand, so this update attends over them exactly, as transformers' QuantizedCache does
(a long prompt's own attention is not perturbed, so no error compounds through the layers);
later updates see them dequantized. A step costs one pass over the packed history plus work
bounded by the residual.

Storage kinds
- full: the store grows one block at a time, so its bytes are exactly the packed size (a regrow
  copies the packed history once per block: a small fraction of the per-step dequantization).
- sliding (``window``): transformers' sliding contract exactly, like ``SlidingLayer`` (an update
  of ``T`` tokens returns the last ``window - 1 + T``); the store is a ``SlidingLayer`` of
  ``ceil((window - 1) / group_size) + 1`` blocks, enough to cover the window. ``record_past``
  reaches the store.
- static (``max_length``): supported. The store is a ``StaticLayer`` preallocated for
  ``max_length // group_size`` blocks; an update past ``max_length`` raises ``CacheError``.
  Outputs have the dynamic length ``seq_length()`` (mask sizes as ``full``), so it is not
  CUDA-graph capturable (``is_compileable`` is False).

Cache ops act on blocks and residual alike. ``crop`` reaching into the blocks drops whole
blocks from the store and moves the kept head of the cut block back into the residual as its
dequantized values (exactly what attention saw); those tokens are quantized once more when
they leave the residual again (the only case a value is quantized twice).
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer, check_batch_indices, check_crop, check_repeats
from tiercache.layers.buffer import Buffer
from tiercache.layers.spec import KVSpec
from tiercache.processors import backends
from tiercache.processors.blocks import BlockCodec
from tiercache.tiers import ComputeTier


class Quantize(KVLayer):
    def __init__(self, make_store, config, window: int | None = None, max_length: int | None = None):
        self.config = config
        self.backend = backends.get(config)
        self.g, self.r = config.group_size, config.residual_length
        self.window, self.limit = window, max_length
        self.is_sliding = window is not None
        chunk = 1  # blocks of capacity added at a time: nbytes() stays the packed size
        if window is not None:
            if not isinstance(window, int) or window < 1:
                raise CacheError(f"sliding window must be an int >= 1, got {window!r}")
            self.store = make_store(window=-(-(window - 1) // self.g) + 1, chunk=chunk)
        elif max_length is not None:
            if not isinstance(max_length, int) or max_length < 1:
                raise CacheError(f"static storage needs max_length >= 1, got {max_length!r}")
            self.store = make_store(max_length=max(1, max_length // self.g))
        else:
            self.store = make_store(chunk=chunk)
        self.residual = Buffer(ComputeTier(), chunk=self.r + self.g)  # [B, H, < R + G, D]
        self.spec: KVSpec | None = None
        self.codecs: tuple[BlockCodec, BlockCodec] | None = None
        self.seen = 0  # tokens seen (positions), including any slid out of a window
        self.stored = False  # the store has had an update (knows batch, dtype, device)

    # -- the protocol ---------------------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = KVSpec.of(key, value) if self.spec is None else self.spec
        spec.check(key, value)
        t = key.shape[2]
        if self.limit is not None and self.seen + t > self.limit:
            raise CacheError(
                f"static storage is full: it holds {self.seen} of max_length={self.limit} tokens and "
                f"cannot take {t} more; raise max_length in the policy or use storage: full"
            )
        if self.codecs is None:
            self.codecs = tuple(BlockCodec(self.backend, self.g, d, axis, spec.dtype) for d, axis in
                                ((spec.key_dim, self.config.key_axis), (spec.value_dim, self.config.value_axis)))
        self.spec = spec
        held = len(self.residual)
        flush = max(0, (held + t - self.r) // self.g) * self.g  # oldest tokens to pack now
        taken = min(flush, held)
        if flush:
            old_k, old_v = self.residual.view(0, taken) if taken else (key[:, :, :0], value[:, :, :0])
            if flush > held:  # the block runs into the new tokens (bounded by this update)
                old_k = torch.cat([old_k, key[:, :, : flush - held]], dim=2)
                old_v = torch.cat([old_v, value[:, :, : flush - held]], dim=2)
            blocks = self.store.update(self.codecs[0].encode(old_k), self.codecs[1].encode(old_v))
            self.stored = True
        else:
            blocks = self._held_blocks()
        if blocks is not None:
            n = self.store.seq_length() if self.limit is not None else blocks[0].shape[2]
            n -= flush // self.g  # blocks packed just now are still in hand at full precision
            blocks = blocks[0][:, :, :n], blocks[1][:, :, :n]
        out = self._assemble(blocks, (key, value), None if self.window is None else self.window - 1 + t)
        self.residual.drop_front(taken)
        if t > flush - taken:
            self.residual.append(key[:, :, flush - taken :], value[:, :, flush - taken :])
        self.seen += t
        return out

    def seq_length(self) -> int:
        return self.seen

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.window is None:
            return self.seen + query_length, 0
        offset = max(self.seen - self.window + 1, 0)
        if self.seen >= self.window:
            return self.window - 1 + query_length, offset
        return self.seen + query_length, offset

    def max_length(self) -> int:
        return self.window if self.window is not None else (self.limit if self.limit is not None else -1)

    def crop(self, n: int) -> None:
        check_crop(n, self.seen)
        held = len(self.residual)
        if n <= held:
            if self.stored:
                self.store.crop(0)  # a sliding store trims what it kept for a rollback
            self.residual.truncate(n)
            self.seen -= n
            return
        cut = n - held  # tokens to remove from the blocks
        drop = -(-cut // self.g)  # whole blocks dropped from the store
        keep = drop * self.g - cut  # head of the cut block that stays (dequantized)
        blocks = self._held_blocks()
        have = 0 if blocks is None else blocks[0].shape[2]
        if drop > have:
            raise CacheError(
                f"cannot crop {n} tokens: {cut} of them are in quantized blocks but only {have} blocks "
                f"({have * self.g} tokens) are kept; tokens before the window are gone; call record_past(True) "
                "(activate_past_recording) before updates you may want to roll back"
            )
        restored = None
        if keep:
            at = have - drop
            restored = [torch.empty((*b.shape[:2], self.g, d), dtype=self.spec.dtype, device=b.device)
                        for b, d in zip(blocks, (self.spec.key_dim, self.spec.value_dim))]  # [B, H, G, D]
            for codec, b, out in zip(self.codecs, blocks, restored):
                codec.decode(b[:, :, at : at + 1], out)
        self.store.crop(drop)  # raises (nothing changed yet) when the store cannot
        self.residual.truncate(held)
        if restored is not None:
            device = self.spec.device
            self.residual.append(restored[0][:, :, :keep].to(device), restored[1][:, :, :keep].to(device))
        self.seen -= n

    def reorder(self, beam_idx: torch.Tensor) -> None:
        if self.spec is not None:
            self._gather("reorder", check_batch_indices(beam_idx, self.spec.batch, "reorder"))

    def select(self, indices: torch.Tensor) -> None:
        if self.spec is not None:
            self._gather("select", check_batch_indices(indices, self.spec.batch, "select"))

    def repeat_interleave(self, repeats: int) -> None:
        check_repeats(repeats)
        if self.spec is not None:
            if self.stored:
                self.store.repeat_interleave(repeats)
            self._gather(None, torch.arange(self.spec.batch).repeat_interleave(repeats))

    def reset(self) -> None:
        self.store.reset()
        self.residual.clear()
        self.spec, self.codecs, self.seen, self.stored = None, None, 0, False

    def kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.spec is None or (not len(self.residual) and self._held_blocks() is None):
            return None
        return self._assemble(self._held_blocks(), None, None)

    def nbytes(self) -> dict[str, int]:
        out = dict(self.store.nbytes())
        for place, size in self.residual.nbytes().items():
            out[place] = out.get(place, 0) + size
        return out

    def prefetch(self) -> None:
        self.store.prefetch()

    def record_past(self, on: bool) -> None:
        self.store.record_past(on)

    def close(self) -> None:
        self.store.close()
        self.residual.clear()

    # -- internals ------------------------------------------------------------------------------
    def _held_blocks(self):
        if not self.stored:
            return None
        return self.store.kv()  # [B, H, N, row] each, or None

    def _assemble(self, blocks, new, visible: int | None):
        """Dequantized blocks, the residual, then ``new`` tokens: one fresh ``[B, H, S, D]`` per K and V."""
        held, fresh = len(self.residual), (0 if new is None else new[0].shape[2])
        n = 0 if blocks is None else blocks[0].shape[2]
        skip = 0
        if visible is not None and n * self.g + held + fresh > visible:  # sliding: the window's tail only
            skip = n * self.g + held + fresh - visible
            first = min(skip // self.g, n)
            blocks = None if blocks is None else (blocks[0][:, :, first:], blocks[1][:, :, first:])
            n -= first
            skip -= first * self.g
        s, res = self.spec, self.residual.view() if held else None
        outs = []
        for i, d in enumerate((s.key_dim, s.value_dim)):
            out = torch.empty((s.batch, s.heads, n * self.g + held + fresh, d), dtype=s.dtype, device=s.device)  # [B, H, S, D]
            at = n * self.g
            if n:
                self.codecs[i].decode(blocks[i].to(s.device, non_blocking=True), out[:, :, :at])
            if held:
                out[:, :, at : at + held].copy_(res[i])
            if fresh:
                out[:, :, at + held :].copy_(new[i])
            outs.append(out[:, :, skip:] if skip else out)
        return outs[0], outs[1]

    def _gather(self, op: str | None, index: torch.Tensor) -> None:
        if op is not None and self.stored:
            getattr(self.store, op)(index)  # validates before the residual changes
        self.residual.gather(index.to(self.spec.device))
        self.spec = self.spec.with_batch(index.numel())
