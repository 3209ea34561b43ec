"""``CrossAttention``: the outermost processor of a cross-attention layer (encoder-decoder models).

    CrossAttention(inner, fresh_reads=False) -> a ``Delegating`` layer around ``inner``;
        ``fresh_reads``: ``inner.kv(fetch=True)`` returns fresh tensors (a quantized chain dequantizes),
        so one read serves ``keys`` and the ``values`` read that follows it

Encoder-decoder models (BART, T5, Whisper ...) write a layer's cross-attention K/V once, from the
encoder output, and on every later step read them back through transformers' layer attributes
``keys`` and ``values`` (``cache.cross_attention_cache.layers[i].keys``) instead of calling
``update``. This processor changes exactly those two read-only attributes: each is
``inner.kv(fetch=True)``'s key (value) part, so whatever ``inner`` is (full storage, ``Quantize``,
``Offload`` or both) the model reads the full-precision K/V on the compute device: views of the
storage, a prefetched mirror, or freshly dequantized tensors. ``None`` while the layer is empty
(transformers' empty-layer convention). Everything else is ``inner``'s (``Delegating``).

Models read ``keys`` then ``values`` of a layer back to back. With ``fresh_reads`` the pair read
for ``keys`` is kept for that ``values`` read (one dequantization per step, not two), and dropped
by it or by any call that changes the layer (``changing``); views of storage or of an offload
mirror (which the next layer's fetch may reuse) are never kept. Its state is the wrapped chain's
state as it is (no prefix).
"""

from __future__ import annotations

import torch

from tiercache.layers.base import KVLayer
from tiercache.layers.delegating import Delegating


class CrossAttention(Delegating):
    def __init__(self, inner: KVLayer, fresh_reads: bool = False):
        super().__init__(inner)
        self.fresh_reads = fresh_reads
        self._read: tuple[torch.Tensor, torch.Tensor] | None = None  # the pair read for keys, kept for values

    def changing(self) -> None:
        self._read = None

    @property
    def keys(self) -> torch.Tensor | None:  # [B, H, S_enc, Dk]
        held = self.inner.kv(fetch=True)
        self._read = held if self.fresh_reads else None
        return None if held is None else held[0]

    @property
    def values(self) -> torch.Tensor | None:  # [B, H, S_enc, Dv]
        held, self._read = (self._read or self.inner.kv(fetch=True)), None
        return None if held is None else held[1]
