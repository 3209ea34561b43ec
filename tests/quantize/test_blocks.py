"""``BlockCodec.decode`` writes into the caller's output whatever its layout: all bit planes at once
into a contiguous output (a block's ``[G, D]`` one run of memory), plane by plane into a strided
one (a channel slice of a wider tensor), the same values either way and nothing outside the slice;
and the planar ``pack`` / ``unpack`` pair is lossless for every width."""

from __future__ import annotations

import pytest
import torch

from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import backends
from tiercache.quantize.blocks import BlockCodec, pack, unpack


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("e", [64, 67])
def test_pack_unpack_is_lossless(bits, e):
    codes = torch.randint(0, 2**bits, (2, 3, e), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.shape[-1] == -(-e * bits // 8)
    assert torch.equal(unpack(packed, bits, e), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decode_into_strided_output_equals_contiguous(bits, axis, dtype):
    g, d = 32, 16
    codec = BlockCodec(backends.get(QuantizePolicy(bits=bits, group_size=g)), g, d, axis, dtype)
    x = torch.randn(2, 3, 3 * g, d, generator=torch.Generator().manual_seed(bits)).to(dtype)  # [B, H, T, D]
    rows = codec.encode(x)
    dense = torch.empty_like(x)
    codec.decode(rows, dense)
    wide = torch.full((2, 3, 3 * g, 3 * d), 7.0, dtype=dtype)  # [B, H, T, 3D]: the output is its middle third
    codec.decode(rows, wide[..., d : 2 * d], remember=False)
    assert torch.equal(wide[..., d : 2 * d], dense)
    assert bool((wide[..., :d] == 7).all() and (wide[..., 2 * d :] == 7).all())
    window = torch.empty((2, 3, 5 * g, d), dtype=dtype)  # a token slice of a longer buffer stays contiguous per block
    codec.decode(rows, window[:, :, g : 4 * g], remember=False)
    assert torch.equal(window[:, :, g : 4 * g], dense)
    top = x.float().abs().amax().item()
    step = top * 2 / (2**bits - 1) + torch.finfo(dtype).eps * top  # a step of the widest group, and the dtype's rounding
    assert (dense.float() - x.float()).abs().max().item() <= step  # and it is x, within its format's error
