"""``CompressedLayer``: a DeepSeek-V4 compressed-attention layer (``compressed_sparse_attention``:
CSA, ``heavily_compressed_attention``: HCA), transformers' ``DeepseekV4CSACache`` /
``DeepseekV4HCACache`` here.

    CompressedLayer(attention, layer_type, window, compress_rate)   a ``WithSideState``
    layer.store_compression_weights(name, kv, gate)     \\
    layer.update_compressor_states(name, compressed)     > transformers' methods, which DeepSeek-V4's
    layer.update_overlap_state(name, kv, gate, dim)     /  compressors call on ``cache.layers[i]``

What such a layer keeps (transformers 5.24, ``modeling_deepseek_v4``), and where it is here:
- a sliding window of the newest ``sliding_window - 1`` tokens' K (= V: one shared-KV head):
  ``attention``, the layer's sliding chain, tiered by the policy like any sliding layer
  (quantized when its window is longer than ``residual_length + 1``; offloaded only when an
  override asks, as sliding layers are). The model passes the same tensor as key and value;
  tiercache holds the two (twice transformers' bytes for this part, which shares one buffer).
- the compressor state, per entry (``"compressor"``; CSA also ``"indexer"``): the tokens
  buffered until a window of ``compress_rate`` closes (``buffer_kv`` / ``buffer_gate``), the
  compressed entries emitted so far (``compressed_kv``, one per ``compress_rate`` tokens:
  ``[B, S / rate, head_dim]``), their count, and CSA's overlap slice of the last window
  (``overlap_kv`` / ``overlap_gate``). This is not K/V of tokens but the running output of
  learned pooling, read whole at every step by the attention and (CSA) by the lightning
  indexer that picks the top-k entries: it is kept **exact, on the model's device**, in
  transformers' own layer object (composition: ``CompressorState.held`` is a
  ``DeepseekV4CSACache`` / ``DeepseekV4HCACache`` whose compressor methods do the
  bookkeeping; its own sliding K/V is never used). Quantizing the entries would move the
  indexer's discrete top-k choice, and they are already ``compress_rate`` times fewer than
  the tokens (4 for CSA, 128 for HCA).
So an int4 policy on DeepSeek-V4 quantizes the sliding windows of all its layers (plain
``sliding_attention`` layers and the compressed layers' windows) and nothing of the compressor
state. The compressor state is counted by ``nbytes()`` / ``tier_nbytes()`` (device bytes),
kept by save / load, fork and retier (moved as held), gathered by beam reorder / batch select /
repeat. ``crop(n > 0)`` is refused once the state holds anything (it cannot be rolled back:
transformers' DeepSeek-V4 opts out of the generation modes that roll back, ``_is_stateful``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tiercache.cache.side_state import SideState, WithSideState
from tiercache.errors import CacheError
from tiercache.layers.state import field

COMPRESSED_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
_TENSOR_DICTS = ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate")


def _transformers_layer(layer_type: str, window: int, rate: int):
    """transformers' own DeepSeek-V4 cache layer for ``layer_type`` (imported on first use)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    cls = {"compressed_sparse_attention": v4.DeepseekV4CSACache,
           "heavily_compressed_attention": v4.DeepseekV4HCACache}[layer_type]
    config = SimpleNamespace(sliding_window=window, compress_rates=dict.fromkeys(COMPRESSED_TYPES, rate))
    return cls(config)


class CompressorState(SideState):
    kind = "compressed"

    def __init__(self, layer_type: str, window: int, compress_rate: int):
        if layer_type not in COMPRESSED_TYPES:
            raise CacheError(f"a compressed layer is one of {', '.join(COMPRESSED_TYPES)}, got {layer_type!r}")
        if not isinstance(compress_rate, int) or compress_rate < 1:
            raise CacheError(f"{layer_type}: compress_rate must be a positive int, got {compress_rate!r}")
        self.layer_type, self.window, self.rate = layer_type, window, compress_rate
        self.held = _transformers_layer(layer_type, window, compress_rate)

    @classmethod
    def empty_like(cls, other: "CompressorState") -> "CompressorState":
        return cls(other.layer_type, other.window, other.rate)

    def _dicts(self) -> dict[str, dict]:
        return {a: getattr(self.held, a) for a in _TENSOR_DICTS if hasattr(self.held, a)}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{a}.{name}": t for a, d in self._dicts().items() for name, t in d.items() if t is not None}

    def meta(self) -> dict:
        return {"layer_type": self.layer_type, "rate": self.rate,
                **{f"entries.{name}": n for name, n in self.held.entry_count.items()}}

    def load(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        if meta.get("layer_type") != self.layer_type or field(meta, "rate", self.kind) != self.rate:
            raise CacheError(f"state of a compressed layer: saved as {meta.get('layer_type')!r} at rate "
                             f"{meta.get('rate')!r}; this layer is {self.layer_type!r} at rate {self.rate}")
        self.reset()
        dicts = self._dicts()
        for key, t in tensors.items():
            attr, _, name = key.partition(".")
            if attr not in dicts or name not in dicts[attr]:
                raise CacheError(f"state of a compressed layer: unknown entry {key!r}")
            dicts[attr][name] = t.clone()
        for name in self.held.entry_count:
            self.held.entry_count[name] = field(meta, f"entries.{name}", self.kind)

    def index(self, idx: torch.Tensor) -> None:
        for d in self._dicts().values():
            for name, t in d.items():
                if t is not None:
                    d[name] = t.index_select(0, idx.to(t.device))

    def holds(self) -> bool:
        return bool(self.tensors()) or any(self.held.entry_count.values())

    def validate_crop(self, n: int) -> None:
        if n > 0 and self.holds():
            raise CacheError(f"crop: a {self.layer_type} layer's compressor state (buffered tokens, compressed "
                             "entries) only runs forward and cannot be rolled back (transformers' DeepSeek-V4 "
                             "opts out of the generation modes that roll back, too)")

    def crop(self, n: int) -> None:
        self.validate_crop(n)

    def reset(self) -> None:
        self.held = _transformers_layer(self.layer_type, self.window, self.rate)


class CompressedLayer(WithSideState):
    def __init__(self, attention, layer_type: str, window: int, compress_rate: int):
        super().__init__(attention, CompressorState(layer_type, window, compress_rate))

    @property
    def compress_rate(self) -> int:
        return self.side.rate

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        return self.side.held.store_compression_weights(name, kv, gate)

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        return self.side.held.update_compressor_states(name, compressed)

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        if not hasattr(self.side.held, "update_overlap_state"):
            raise CacheError(f"update_overlap_state: a {self.side.layer_type} layer keeps no overlap state "
                             "(only compressed_sparse_attention layers do)")
        return self.side.held.update_overlap_state(name, chunk_kv, chunk_gate, head_dim)
