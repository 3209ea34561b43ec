"""``quantized(config, shared=None, window=None, max_length=None)``: a resident ``Quantize`` layer
as the chain builder makes it (``build(spec_for(lp), shared)``), for the processor tests.

``shared=None``: no shared workspace (every update returns fresh tensors).
"""

from __future__ import annotations

from tiercache.cache.chain import build
from tiercache.cache.chainspec import spec_for
from tiercache.policy.schema import LayerPolicy, QuantizePolicy


def quantized(config: QuantizePolicy, shared=None, window: int | None = None, max_length: int | None = None):
    storage = "sliding" if window is not None else ("static" if max_length is not None else "full")
    kind = "sliding_attention" if window is not None else "full_attention"
    return build(spec_for(LayerPolicy(0, kind, storage, window, max_length, config, None)), shared)
