"""``Delegating``: a wrapper states only what it changes, and behaves as the layer it wraps.

Checked against the plain layer as the reference: the same answers for every call of the
protocol (update, crop, the batch gathers, export, state_dict round trip), and ``changing()``
runs before each call that changes the layer, never before a read.
"""

from __future__ import annotations

import pytest
import torch

from tiercache.errors import CacheError
from tiercache.layers.delegating import Delegating
from tiercache.layers.full import FullLayer
from tiercache.layers.sliding import SlidingLayer


class Counting(Delegating):  # a wrapper that changes one behaviour: it counts the changes
    def __init__(self, inner):
        super().__init__(inner)
        self.changes = 0

    def changing(self) -> None:
        self.changes += 1


def kv(t: int, batch: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, t, 8, generator=g), torch.randn(batch, 2, t, 4, generator=g)  # [B, H, T, D]


@pytest.mark.parametrize("make", [FullLayer, lambda: SlidingLayer(4)], ids=["full", "sliding"])
def test_a_wrapper_answers_as_the_layer_it_wraps(make):
    ref, wrapped = make(), Counting(make())
    for step, t in enumerate([5, 1, 1, 3]):
        for a, b in zip(ref.update(*kv(t, seed=step)), wrapped.update(*kv(t, seed=step))):
            assert torch.equal(a, b)
    ops = [lambda l: l.reorder(torch.tensor([2, 0, 1])), lambda l: l.select(torch.tensor([0, 2])),
           lambda l: l.repeat_interleave(2), lambda l: l.crop(0 if l.is_sliding else 1)]
    for op in ops:
        before = wrapped.changes
        op(ref), op(wrapped)
        assert wrapped.changes == before + 1
        assert ref.batch_size() == wrapped.batch_size() and ref.seq_length() == wrapped.seq_length()
        assert all(torch.equal(a, b) for a, b in zip(ref.kv(), wrapped.kv()))
    reads = wrapped.changes
    wrapped.export(), wrapped.kv(), wrapped.nbytes(), wrapped.mask_sizes(1), wrapped.layout()
    assert wrapped.changes == reads  # reads change nothing
    twin = Counting(make())
    twin.load_state_dict(wrapped.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(twin.export()[:2], ref.export()[:2]))
    assert twin.export()[2] == ref.export()[2] == ref.seq_length()


def test_the_batch_gathers_are_checked_once_before_any_change():
    layer = Counting(FullLayer())
    layer.update(*kv(2))
    assert layer.changes == 1  # the append
    with pytest.raises(CacheError, match="reorder"):
        layer.reorder(torch.tensor([0, 1]))  # a beam reorder keeps the batch of 3
    with pytest.raises(CacheError, match="select"):
        layer.select(torch.tensor([5]))
    with pytest.raises(CacheError, match="repeat_interleave"):
        layer.repeat_interleave(0)
    assert layer.changes == 1 and layer.batch_size() == 3
    Counting(FullLayer()).select(torch.tensor([0]))  # never written: nothing to gather, as transformers
