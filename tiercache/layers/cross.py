"""``CrossAttention``: the outermost processor of a cross-attention layer (encoder-decoder models).

    CrossAttention(inner, fresh_reads=False) -> a layer (``tiercache.layers.base`` protocol) that
        delegates to ``inner``; ``fresh_reads``: ``inner.kv()`` returns fresh tensors (a quantized
        chain dequantizes), so one read serves ``keys`` and the ``values`` read that follows it

Encoder-decoder models (BART, T5, Whisper ...) write a layer's cross-attention K/V once, from the
encoder output, and on every later step read them back through transformers' layer attributes
``keys`` and ``values`` (``cache.cross_attention_cache.layers[i].keys``) instead of
calling ``update``. This processor adds exactly those two read-only attributes: each is
``inner.kv()``'s key (value) part, so whatever ``inner`` is (full storage, ``Quantize``,
``Offload`` or both) the model reads the full-precision K/V on the compute device: views of the
storage, a prefetched mirror, or freshly dequantized tensors. ``None`` while the layer is empty
(transformers' empty-layer convention). Everything else is ``inner``'s, unchanged.

Models read ``keys`` then ``values`` of a layer back to back. With ``fresh_reads`` the pair read
for ``keys`` is kept for that ``values`` read (one dequantization per step, not two), and dropped
by it or by any call that changes the layer; views of storage or of an offload mirror (which the
next layer's fetch may reuse) are never kept.

Storage layers keep ``keys`` / ``values`` attributes of their own (a static layer's buffer), so
these names live here, on the chain's outside, and only for cross-attention layers.
"""

from __future__ import annotations

import torch

from tiercache.layers.base import KVLayer


class CrossAttention(KVLayer):
    def __init__(self, inner: KVLayer, fresh_reads: bool = False):
        self.inner = inner
        self.is_sliding = inner.is_sliding
        self.fresh_reads = fresh_reads
        self._read: tuple[torch.Tensor, torch.Tensor] | None = None  # the pair read for keys, kept for values

    # -- transformers' read-back attributes ---------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:  # [B, H, S_enc, Dk]
        held = self.inner.kv()
        self._read = held if self.fresh_reads else None
        return None if held is None else held[0]

    @property
    def values(self) -> torch.Tensor | None:  # [B, H, S_enc, Dv]
        held, self._read = (self._read or self.inner.kv()), None
        return None if held is None else held[1]

    # -- the protocol, delegated ------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._read = None
        return self.inner.append(key, value)

    def layout(self):
        return self.inner.layout()

    def seq_length(self) -> int:
        return self.inner.seq_length()

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.mask_sizes(query_length)

    def max_length(self) -> int:
        return self.inner.max_length()

    def validate_crop(self, n: int) -> None:
        self.inner.validate_crop(n)

    def crop(self, n: int) -> None:
        self._read = None
        self.inner.crop(n)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self._read = None
        self.inner.reorder(beam_idx)

    def select(self, indices: torch.Tensor) -> None:
        self._read = None
        self.inner.select(indices)

    def repeat_interleave(self, repeats: int) -> None:
        self._read = None
        self.inner.repeat_interleave(repeats)

    def reset(self) -> None:
        self._read = None
        self.inner.reset()

    def kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.inner.kv()

    def peek(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.inner.peek()

    @property
    def is_initialized(self) -> bool:
        return self.inner.is_initialized

    def nbytes(self) -> dict[str, int]:
        return self.inner.nbytes()

    def tier_nbytes(self) -> dict[str, int]:
        return self.inner.tier_nbytes()

    def batch_size(self) -> int | None:
        return self.inner.batch_size()

    # -- lifecycle: no state of its own, so the wrapped chain's state as it is (no prefix) ----
    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self._read = None
        self.inner.load_state_dict(sd)

    def export(self):
        return self.inner.export()

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        self._read = None
        self.inner.ingest(key, value, seen)

    def prefetch(self) -> None:
        self.inner.prefetch()

    def evict(self) -> None:
        self._read = None
        self.inner.evict()

    def can_adopt(self, other: KVLayer) -> bool:
        return isinstance(other, CrossAttention) and self.inner.can_adopt(other.inner)

    def adopt(self, other: "CrossAttention") -> None:
        self._read = None
        self.inner.adopt(other.inner)

    def set_recording(self, on: bool) -> None:
        self._read = None
        self.inner.set_recording(on)

    @property
    def recording(self) -> bool:
        return self.inner.record_past

    def close(self) -> None:
        self._read = None
        self.inner.close()
