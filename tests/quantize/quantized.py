"""``quantized(config, shared=None, window=None, max_length=None)``: a resident ``Quantize`` layer
as the chain builder makes it (``build(spec_for(lp), shared)``), for the processor tests.

``shared=None``: no shared workspace (every update returns fresh tensors).
``PACKED_LAYOUTS``: every quantized layout packed attention serves (the packed-attention tests and
the Triton interpreter tests parametrize over it).
"""

from __future__ import annotations

import pytest

from tiercache.cache.chain import build
from tiercache.planner.chainspec import spec_for
from tiercache.policy.schema import LayerPolicy, QuantizePolicy


def quantized(config: QuantizePolicy, shared=None, window: int | None = None, max_length: int | None = None):
    storage = "sliding" if window is not None else ("static" if max_length is not None else "full")
    kind = "sliding_attention" if window is not None else "full_attention"
    return build(spec_for(LayerPolicy(0, kind, storage, window, max_length, config, None)), shared)


PACKED_LAYOUTS = [
    pytest.param(dict(bits=4), id="int4"),
    pytest.param(dict(bits=2), id="int2"),
    pytest.param(dict(bits=8), id="int8"),
    pytest.param(dict(bits=4, key_axis="token"), id="int4-keys-token"),
    pytest.param(dict(bits=2, key_axis="token", value_axis="channel"), id="int2-keys-token-values-channel"),
    pytest.param(dict(bits=4, value_axis="channel"), id="int4-values-channel"),
    pytest.param(dict(bits=4, meta_bits=8), id="int4-meta8"),
    pytest.param(dict(bits=2, meta_bits=8, key_axis="token"), id="int2-meta8-keys-token"),
    pytest.param(dict(bits=8, format="fp8"), id="fp8"),
    pytest.param(dict(bits=4, sink_tokens=4), id="int4-sinks"),
    pytest.param(dict(bits=2, key_bits=4, key_gain=1.5, sink_tokens=3), id="K4V2-gain-sinks"),
    pytest.param(dict(bits=4, clip="mse"), id="int4-clip"),
]
