"""The decode step of a growable buffer (``Buffer.append_view``): one token in, every held token
out, as views of the buffer's own memory, exactly what a concatenation would return, through
regrowth, crops, batch gathers, reservations and memory lent by another owner."""

import torch

from tiercache.layers import buffer as buffer_module
from tiercache.layers.buffer import Buffer
from tiercache.layers.full import FullLayer
from tiercache.layers.tiers import ComputeTier

B, H, DK, DV = 2, 3, 4, 5


def token(t=1, batch=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, H, t, DK, generator=g)
    v = torch.randn(batch, t, H, DV, generator=g).transpose(1, 2)  # non-contiguous, as a model's values
    return k, v


def shares(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_decode_steps_return_views_equal_to_a_concatenation_through_regrowth_crop_gather_and_reserve():
    buf = Buffer(ComputeTier(), chunk=8, geometric=True)
    ref_k, ref_v = token(5, seed=1)
    buf.append(ref_k, ref_v)
    batch = B
    for step in range(40):
        k, v = token(batch=batch, seed=100 + step)
        out_k, out_v = buf.append_view(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
        assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
        assert shares(out_k, buf.keys) and shares(out_v, buf.values)  # views, no copy
        if step == 10:
            buf.truncate(3)
            ref_k, ref_v = ref_k[:, :, :-3], ref_v[:, :, :-3]
        if step == 20:
            index = torch.tensor([1, 1, 0])  # repeat-interleave, reorder: the batch changes
            buf.gather(index)
            ref_k, ref_v, batch = ref_k[index], ref_v[index], 3
        if step == 25:
            buf.reserve(100)
            assert buf.capacity == 104
    assert buf.capacity == 104 and len(buf) == ref_k.shape[2]


def test_a_buffer_lent_a_slot_writes_into_it_and_after_detach_allocates_its_own():
    slots = torch.zeros(3, H, 16, DK), torch.zeros(3, H, 16, DV)  # [S, H, C, D]: a workspace, slot 1 lent
    buf = Buffer(ComputeTier(), chunk=8, geometric=True)
    k0, v0 = token(4, batch=1, seed=2)
    buf.append(k0, v0)
    slots[0][1, :, :4], slots[1][1, :, :4] = k0[0], v0[0]
    buf.lend(slots[0].narrow(0, 1, 1), slots[1].narrow(0, 1, 1), 4)
    assert buf.lent and buf.own_capacity() == 8  # a copy of it takes its own room, not the slot's 16
    k, v = token(batch=1, seed=3)
    out_k, out_v = buf.append_view(k, v)
    assert torch.equal(out_k, torch.cat([k0, k], 2)) and torch.equal(out_v, torch.cat([v0, v], 2))
    assert torch.equal(slots[0][1, :, 4], k[0, :, 0]) and torch.equal(slots[1][1, :, 4], v[0, :, 0])
    assert not slots[0][0].any() and not slots[0][2].any()  # the other slots untouched
    assert out_k.data_ptr() == slots[0][1].data_ptr()
    buf.truncate(5)
    buf.detach()
    assert buf.keys is None and len(buf) == 0 and buf.spec is not None and not buf.lent
    out_k, _ = buf.append_view(k, v)
    assert torch.equal(out_k, k) and not shares(out_k, slots[0])


def test_a_full_layer_steps_through_the_same_path_as_a_several_token_update():
    one, many = FullLayer(chunk=8), FullLayer(chunk=8)
    k, v = token(20, seed=4)
    one.append(k[:, :, :3], v[:, :, :3])
    for i in range(3, 20):
        out = one.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
    ref = many.append(k, v)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert one.nbytes() == many.nbytes()  # the same capacity ladder, however the tokens came


def test_the_position_table_holds_each_position_and_stays_small():
    table = buffer_module._positions(torch.device("cpu"))
    assert table is buffer_module._positions(torch.device("cpu"))  # one per device
    for i in range(3 * table.KEEP):
        at = table[i]
        assert at.dtype == torch.int64 and at.tolist() == [i]
        assert len(table) <= table.KEEP
    # views of one arange made on the device: no host-to-device copy per step (a CUDA sync)
    assert table[5].data_ptr() == table.table.data_ptr() + 5 * table.table.element_size()
    assert table[1000].tolist() == [1000] and len(table.table) > 1000  # the table grows past a position
