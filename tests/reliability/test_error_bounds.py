"""How approximate quantization is: the native integer formats' per-group min-max bound.

Every value of a group comes back within half a quantization step of itself,
``|x - x'| <= (max - min) / (2**bits - 1) / 2`` of its group (float32 keys/values; a
rounding-sized slack), whatever the data: outliers only widen their own group's step. A group
is one channel over ``group_size`` tokens (``axis: channel``) or a run of channels of one token
(``axis: token``). Constant groups come back exact.
"""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import backends
from tiercache.quantize.blocks import BlockCodec, token_groups


@settings(max_examples=2000 if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else 60)
@given(bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([2, 4, 8, 32]), dim=st.sampled_from([4, 6, 8, 16]),
       axis=st.sampled_from(["channel", "token"]), seed=st.integers(0, 2**16),
       magnitude=st.sampled_from([1e-3, 1.0, 1e3]), outlier=st.booleans())
def test_error_within_half_a_step_per_group(bits, group, dim, axis, seed, magnitude, outlier):
    codec = BlockCodec(backends.get(QuantizePolicy(bits=bits, group_size=group)), group, dim, axis, torch.float32)
    x = torch.randn(2, 2, 2 * group, dim, generator=torch.Generator().manual_seed(seed)) * magnitude  # 2 blocks
    if outlier:
        x[0, 1, 1, 0] = 50 * magnitude
    y = codec.roundtrip(x)
    blocks = x.view(2, 2, 2, group, dim)  # [B, H, N, G, D]
    if axis == "channel":
        lo, hi = blocks.amin(3, keepdim=True), blocks.amax(3, keepdim=True)  # per channel of a block
    else:
        n = token_groups(dim, group)
        g = blocks.view(2, 2, 2, group, n, dim // n)
        lo = g.amin(-1, keepdim=True).expand_as(g).reshape(blocks.shape)
        hi = g.amax(-1, keepdim=True).expand_as(g).reshape(blocks.shape)
    step = (hi - lo) / (2**bits - 1)
    err = (y.view_as(blocks) - blocks).abs()
    slack = 1e-5 * blocks.abs().amax() + 1e-30
    assert bool((err <= step / 2 * (1 + 1e-4) + slack).all()), float((err - step / 2).max())
    constant = torch.full((1, 1, group, dim), 0.375 * magnitude)
    assert torch.equal(codec.roundtrip(constant), constant)
