"""``IndexedLayer``: an ``indexed_attention`` layer (Dynamic Sparse Attention: DeepSeek-V3.2,
GLM-MoE-DSA, dots3, HY-V4, AXK2, Qwen4-Exp ...), transformers' ``DynamicIndexedLayer`` here.

    IndexedLayer(attention)                 a ``WithSideState`` (``tiercache.cache.side_state``)
    layer.update_indexer(k) -> keys         append indexer keys ``[B, T, D]``; all of them ``[B, S, D]``
    layer.indexer_keys                      what it holds ``[B, S, D]`` (None before the first)
    layer.indexer_position_ids              ``[P, B, S]`` or None: set by the model (Qwen4-Exp), kept

What transformers keeps per layer, and where it is here:
- the main K/V (``[B, H, S, D]``, MLA latents for the DeepSeek line): ``attention``, the layer's
  chain, tiered by the policy like any full-attention layer (quantized, offloaded, static);
- the indexer keys (one head, ``index_head_dim`` wide): ``IndexerKeys``, exact, on the model's
  device (where the first ``update_indexer`` puts them), in one buffer that grows geometrically
  (doubling, in whole chunks), so decoding appends in place and copies the history only
  ``log2`` times, not once per token as transformers' ``torch.cat``;
- ``indexer_position_ids`` (optional, the model's): kept as the model sets it, cropped /
  reordered / saved with the keys.
``TieredCache.update_indexer(k, i)`` is transformers' ``Cache.update_indexer``, which calls the
layer's own method.

Why the indexer keys are never quantized nor offloaded (a decision): the indexer scores every
held key against each query and keeps the top ``index_topk`` tokens, a discrete choice that
decides which tokens the main attention sees at all. A quantization error moves scores and flips
choices near the cut, so the error is not a small perturbation of attention but a change of its
support; they are read whole at every step, so an offloaded copy would cross the bus whole every
step; and they are small beside the main K/V (one head of ``index_head_dim``, e.g. 128 against
DeepSeek's 576-wide MLA latent per token). They are counted by ``nbytes()`` / ``tier_nbytes()``
(device bytes), kept by save / load, fork and retier (moved as held), cropped with the K/V and
gathered by beam reorder / batch select / repeat.
"""

from __future__ import annotations

import torch

from tiercache.cache.side_state import SideState, WithSideState
from tiercache.errors import CacheError
from tiercache.layers.capacity import CHUNK, capacity_for
from tiercache.layers.state import field


class IndexerKeys(SideState):
    kind = "indexed"

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._buf: torch.Tensor | None = None  # [B, capacity, D]
        self.length = 0
        self.positions: torch.Tensor | None = None  # [P, B, S] (the model's indexer_position_ids)

    @classmethod
    def empty_like(cls, other: "IndexerKeys") -> "IndexerKeys":
        return cls(other.chunk)

    # -- the write path -------------------------------------------------------------------------
    def append(self, keys: torch.Tensor) -> torch.Tensor:
        if not isinstance(keys, torch.Tensor) or keys.dim() != 3:
            raise CacheError(f"update_indexer: indexer keys are a [batch, tokens, index_head_dim] tensor, got "
                             f"{tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys).__name__}")
        b, t, d = keys.shape
        buf = self._buf
        if buf is not None and (buf.shape[0] != b or buf.shape[2] != d or buf.dtype != keys.dtype
                                or buf.device != keys.device):
            raise CacheError(f"update_indexer: the layer holds indexer keys of batch {buf.shape[0]}, width "
                             f"{buf.shape[2]}, {buf.dtype} on {buf.device}; got batch {b}, width {d}, {keys.dtype} "
                             f"on {keys.device} (reset the cache for another shape)")
        need = self.length + t
        if buf is None or need > buf.shape[1]:
            grown = max(capacity_for(need, self.chunk), 2 * (0 if buf is None else buf.shape[1]))
            new = torch.empty(b, grown, d, dtype=keys.dtype, device=keys.device)
            if buf is not None and self.length:
                new[:, :self.length].copy_(buf[:, :self.length])
            self._buf = buf = new
        buf[:, self.length:need].copy_(keys)
        self.length = need
        return buf[:, :need]

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._buf is None else self._buf[:, :self.length]  # [B, S, D]

    # -- the SideState protocol -----------------------------------------------------------------
    def tensors(self, held: bool = False) -> dict[str, torch.Tensor]:
        """The whole buffer (``nbytes`` counts allocated bytes, spare capacity included; ``held``: the
        keys it holds, what a state saves) and the positions."""
        out = {} if self._buf is None else {"keys": self.keys if held else self._buf}
        if self.positions is not None:
            out["positions"] = self.positions
        return out

    def meta(self) -> dict:
        return {"length": self.length}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors(held=True)  # what it holds, not the spare capacity

    def load(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        length = field(meta, "length", self.kind)
        keys, positions = tensors.get("keys"), tensors.get("positions")
        if keys is not None and (keys.dim() != 3 or keys.shape[1] < length):
            raise CacheError(f"state of an indexed layer: keys of shape {tuple(keys.shape)} hold fewer than its "
                             f"length {length} tokens")
        if keys is None and length:
            raise CacheError(f"state of an indexed layer: length {length} but no indexer keys")
        self._buf = None if keys is None else keys[:, :length].clone(memory_format=torch.contiguous_format)
        self.length = length
        self.positions = None if positions is None else positions.clone()

    def batch(self) -> int | None:
        if self._buf is not None:
            return self._buf.shape[0]
        return None if self.positions is None else self.positions.shape[1]

    def index(self, idx: torch.Tensor) -> None:
        if self._buf is not None:
            self._buf = self._buf[:, :self.length].index_select(0, idx.to(self._buf.device))
        if self.positions is not None:
            self.positions = self.positions.index_select(1, idx.to(self.positions.device))

    def crop(self, n: int) -> None:
        """As transformers' ``DynamicIndexedLayer.crop``: the last ``n`` keys and positions go."""
        if n == 0:
            return
        self.length = max(self.length - n, 0)
        if self.positions is not None:
            self.positions = self.positions[..., :max(self.positions.shape[-1] - n, 0)]

    def reset(self) -> None:
        self._buf, self.length, self.positions = None, 0, None


class IndexedLayer(WithSideState):
    def __init__(self, attention, chunk: int = CHUNK):
        super().__init__(attention, IndexerKeys(chunk))

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """transformers' ``update_indexer``: append ``[B, T, D]`` keys, return all held ``[B, S, D]``
        (a view of the buffer, valid until the next call on the cache, as the returned K/V)."""
        return self.side.append(indexer_key_states)

    @property
    def indexer_keys(self) -> torch.Tensor | None:
        return self.side.keys

    @property
    def is_indexer_initialized(self) -> bool:
        return self.side.keys is not None

    @property
    def indexer_position_ids(self) -> torch.Tensor | None:
        return self.side.positions

    @indexer_position_ids.setter
    def indexer_position_ids(self, positions: torch.Tensor | None) -> None:
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.dim() != 3):
            raise CacheError("indexer_position_ids: a [position_dims, batch, tokens] tensor or None, got "
                             f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
        self.side.positions = positions
