"""The block format (``CodecSpec``) and its row layout, which the planner counts by, against the rows
``BlockCodec`` really packs, for integer and fp8 formats on both axes."""

from __future__ import annotations

import pytest
import torch

from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize.blocks import Codec
from tiercache.quantize.codec import CodecSpec

FORMATS = [QuantizePolicy(bits=2, group_size=32), QuantizePolicy(bits=4, group_size=64, key_axis="token"),
           QuantizePolicy(bits=8, group_size=16, value_axis="channel"), QuantizePolicy(bits=8, format="fp8", group_size=32),
           QuantizePolicy(bits=2, key_bits=4, group_size=64), QuantizePolicy(bits=4, key_bits=2, key_axis="token"),
           QuantizePolicy(bits=2, key_bits=4, meta_bits=8), QuantizePolicy(bits=4, meta_bits=8, key_axis="token"),
           QuantizePolicy(bits=4, meta_bits=8, group_size=17, key_axis="token")]  # 17 x 3 groups for 48 channels


@pytest.mark.parametrize("q", FORMATS, ids=["int2", "int4-token", "int8-channel", "fp8", "K4V2", "K2V4-token",
                                     "K4V2-meta8", "int4-token-meta8", "int4-meta8-odd-groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims", [(16, 16), (48, 80), (128, 64)], ids=lambda d: f"k{d[0]}v{d[1]}")
def test_row_layout_is_what_the_codecs_pack(q, dtype, dims):
    spec = CodecSpec.of(q)
    assert spec.policy(q.residual_length, q.sink_tokens) == q  # the inverse of CodecSpec.of
    kc, vc = Codec(spec).for_kv(*dims, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    for codec, dim, which in ((kc, dims[0], "keys"), (vc, dims[1], "values")):
        assert codec.backend.bits == q.bits_of(which)
        rows = codec.encode(torch.randn(2, 3, 2 * q.group_size, dim).to(dtype))  # [B, H, N, row]
        assert rows.shape == (2, 3, 2, spec.row_bytes(dim, which, size))
        assert rows.shape[-1] % size == 0  # every row's metadata lies aligned for a dtype view
        layout = spec.layout(dim, which, size)
        assert (codec.code_bytes, codec.meta_at, codec.groups, codec.ranges_bytes) == (*layout[:3], layout.ranges_bytes)


def test_bits_per_tensor_are_canonical():
    """However a policy says "keys at 4 bits, values at 2", the block format is one and the same."""
    a = CodecSpec.of(QuantizePolicy(bits=2, key_bits=4))
    assert a == CodecSpec.of(QuantizePolicy(bits=4, value_bits=2))
    assert (a.bits_of("keys"), a.bits_of("values"), a.key_bits) == (4, 2, 4)
    assert CodecSpec.of(QuantizePolicy(bits=4, key_bits=4)) == CodecSpec.of(QuantizePolicy(bits=4))
    assert a != CodecSpec.of(QuantizePolicy(bits=2)) and a != CodecSpec.of(QuantizePolicy(bits=4))
    assert a.row_bytes(64, "keys", 2) > a.row_bytes(64, "values", 2)
