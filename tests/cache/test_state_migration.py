"""Files saved before conv / recurrent states became a side state still load, and decode the same.

``tests/cache/saved/{family}-state-layer-v1.safetensors`` were written by the code in which
``StateLayer`` kept its own flat state format (``states``, ``device``, ``previous.{i}``,
``kernel.{i}``, ``state.conv.{i}`` / ``state.recurrent.{i}``, ``attention.*``): the tiny model of
``hybrid_models.build(family)`` (fixed seed), prompt ``hybrid_models.ids()``, policy ``fp``, saved
after the prefill (``hybrid_models.prefilled``). Loaded here, each must decode exactly as a cache
prefilled by today's code, and its layers' states must equal that cache's, tensor for tensor (to
float rounding: the thread count of the process that wrote them may differ).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid_models import build, decode, prefilled
from tiercache import CacheError, TieredCache
from tiercache.cache.state_layer import StateLayer

SAVED = Path(__file__).parent / "saved"


@pytest.mark.parametrize("family", ["falcon_h1", "jamba"])
def test_a_file_saved_by_the_flat_format_loads_and_decodes_the_same(family):
    m = build(family)
    fresh, nxt = prefilled(m, {"name": "fp"})
    loaded = TieredCache.load(SAVED / f"{family}-state-layer-v1.safetensors", m.config)
    assert loaded.get_seq_length() == fresh.get_seq_length() > 0
    for old, new in zip(loaded.layers, fresh.layers):
        assert type(old) is type(new)
        if isinstance(new, StateLayer):
            a, b = old.side.state_tensors(), new.side.state_tensors()
            assert a.keys() == b.keys() and a
            # the files were written by another process: its thread count may round the prefill's sums
            # differently, so the states agree to float rounding, not bit for bit
            assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)
            assert old.has_previous_state() and old.state.conv_kernel_size == new.state.conv_kernel_size
    a, b = decode(m, loaded, nxt), decode(m, fresh, nxt)
    assert len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(a, b))
    assert [x.argmax(-1).tolist() for x in a] == [y.argmax(-1).tolist() for y in b]


def test_the_flat_format_is_upgraded_and_a_wrong_state_count_is_refused():
    layer = StateLayer(1)
    conv, rec = torch.randn(2, 8, 4), torch.randn(2, 4, 16, 16)  # [B, C, K], [B, H, D, N]
    flat = {"kind": "state", "states": 1, "recording": False, "device": "cpu", "previous.0": True, "kernel.0": 4,
            "state.conv.0": conv, "state.recurrent.0": rec}
    layer.load_state_dict(flat)
    assert torch.equal(layer.conv_state(0), conv) and torch.equal(layer.recurrent_state(0), rec)
    assert layer.conv_state(0).data_ptr() != conv.data_ptr()  # its own copy
    assert layer.batch_size() == 2 and layer.state_nbytes() == conv.nbytes + rec.nbytes
    again = StateLayer(1)
    again.load_state_dict(layer.state_dict())  # today's format round-trips
    assert torch.equal(again.recurrent_state(0), rec)
    with pytest.raises(CacheError, match="2 states, this layer keeps 1"):
        StateLayer(1).load_state_dict({**flat, "states": 2})
