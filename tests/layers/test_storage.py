"""Storage layers against transformers' own layers (plain full-precision references).

Random sequences of prefill / decode updates, crops, beam reorders, selects and
repeat-interleaves; after each step the returned K/V, held K/V, lengths and mask sizes must be
identical to the reference.
"""

import random

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tiercache.errors import CacheError
from tiercache.layers.buffer import CHUNK, capacity_for
from tiercache.layers.full import FullLayer
from tiercache.layers.sliding import SlidingLayer
from tiercache.layers.static import StaticLayer

B, H, D = 2, 2, 4


def kv(t, batch=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, H, t, D, generator=g), torch.randn(batch, H, t, D + 1, generator=g)


def pair(kind, window=5):
    if kind == "full":
        return FullLayer(), DynamicLayer()
    return SlidingLayer(window), DynamicSlidingWindowLayer(window)


def seen(ref):
    return ref.get_seq_length()


def assert_same(out, ref_out):
    assert torch.equal(out[0], ref_out[0]) and torch.equal(out[1], ref_out[1])


KINDS = ["full", "sliding"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_transformers(kind, seed):
    rng = random.Random(seed)
    # windows >= 2: transformers keeps every token at window 1 (a -0 slice)
    ours, ref = pair(kind, window=rng.choice([2, 3, 7]))
    batch = B
    for step in range(40):
        op = rng.choice(["prefill", "decode", "decode", "decode", "reorder", "select", "repeat"])
        if op in ("prefill", "decode"):
            t = rng.randint(2, 300) if op == "prefill" else 1
            k, v = kv(t, batch, seed=step)
            assert ours.mask_sizes(t) == ref.get_mask_sizes(t)
            assert_same(ours.update(k, v), ref.update(k, v))
        elif op == "reorder" and seen(ref):
            idx = torch.tensor([rng.randrange(batch) for _ in range(batch)])
            ours.reorder(idx)
            ref.reorder_cache(idx)
        elif op == "select" and seen(ref) and batch > 1:
            idx = torch.tensor(sorted(rng.sample(range(batch), batch - 1)))
            ours.select(idx)
            ref.batch_select_indices(idx)
            batch -= 1
        elif op == "repeat" and seen(ref) and batch < 4:
            ours.repeat_interleave(2)
            ref.batch_repeat_interleave(2)
            batch *= 2
        assert ours.seq_length() == seen(ref)
        held = ours.kv()
        if held is None:
            assert ref.keys is None or ref.keys.shape[2] == 0
        else:
            assert_same(held, (ref.keys, ref.values))


@pytest.mark.parametrize("seed", range(4))
def test_crop_matches_transformers(seed):
    rng = random.Random(seed)
    ours, ref = pair("full")
    for step in range(30):
        k, v = kv(rng.choice([1, 1, 5, 40]), seed=step)
        ours.update(k, v)
        ref.update(k, v)
        if rng.random() < 0.3:
            n = rng.randint(0, seen(ref))
            ours.crop(n)
            ref.crop(-n)
        assert ours.seq_length() == seen(ref)
        if seen(ref):
            assert_same(ours.kv(), (ref.keys, ref.values))


@pytest.mark.parametrize("window", [2, 6])
def test_sliding_rollback_with_recording(window):
    ours, ref = pair("sliding", window)
    ours.set_recording(True)
    ref.activate_past_recording()
    for step in range(25):
        t = 1 + step % 4
        k, v = kv(t, seed=step)
        assert ours.mask_sizes(t) == ref.get_mask_sizes(t)
        assert_same(ours.update(k, v), ref.update(k, v))
        n = step % 3 if step % 3 < t else 0
        ours.crop(n)
        ref.crop(-n)
        assert ours.seq_length() == seen(ref)
        assert_same(ours.kv(), (ref.keys, ref.values))


def test_sliding_crop_past_window_without_recording_is_refused():
    layer = SlidingLayer(3)
    layer.update(*kv(10))
    before = [t.clone() for t in layer.kv()]
    with pytest.raises(CacheError, match="activate_past_recording"):
        layer.crop(2)
    assert layer.seq_length() == 10 and all(torch.equal(a, b) for a, b in zip(before, layer.kv()))
    layer.crop(0)  # trimming is always allowed


def test_full_grows_by_chunks_and_returns_views():
    layer = FullLayer()
    k, v = kv(CHUNK - 1)
    layer.update(k, v)
    storage = layer.buffer.keys.untyped_storage().data_ptr()
    out_k, _ = layer.update(*kv(1))
    assert out_k.untyped_storage().data_ptr() == storage  # a view, no copy
    assert layer.buffer.capacity == CHUNK
    layer.update(*kv(1))
    assert layer.buffer.capacity == capacity_for(CHUNK + 1) == 2 * CHUNK
    elem = 4 * B * H * (D + D + 1)
    assert layer.nbytes() == {"cpu": 2 * CHUNK * elem}


def test_sliding_memory_is_bounded():
    layer = SlidingLayer(16)
    for step in range(3 * CHUNK):
        layer.update(*kv(1, seed=step))
    assert layer.buffer.capacity <= capacity_for(16 + 16)
    assert len(layer.buffer) == 15


def test_static_matches_full_and_refuses_overflow():
    static, full = StaticLayer(max_length=20), FullLayer()
    for t in (7, 1, 1, 5):
        k, v = kv(t, seed=t)
        out = static.update(k, v)
        ref = full.update(k, v)
        n = static.seq_length()
        assert out[0].shape[2] == 20 and torch.equal(out[0][:, :, :n], ref[0])
        assert static.mask_sizes(1) == (20, 0)
    ptr = static.k.data_ptr()
    static.reorder(torch.tensor([1, 0]))
    full.reorder(torch.tensor([1, 0]))
    assert static.k.data_ptr() == ptr  # address kept for compiled graphs
    assert_same(static.kv(), full.kv())
    before = [t.clone() for t in static.kv()]
    with pytest.raises(CacheError, match="max_length=20"):
        static.update(*kv(10))
    assert static.seq_length() == 14 and all(torch.equal(a, b) for a, b in zip(before, static.kv()))
    static.crop(4)
    assert static.seq_length() == 10 and static.is_compileable


BAD_UPDATES = [
    ("rank", lambda: (torch.zeros(B, H, D), torch.zeros(B, H, D)), "rank 4"),
    ("heads", lambda: kv(1, B)[0][:, :1].clone(), "head count"),
    ("batch", lambda: kv(1, B + 1), "batch size"),
    ("dtype", lambda: tuple(t.double() for t in kv(1)), "dtype"),
    ("head_dim", lambda: (torch.zeros(B, H, 1, D + 2), torch.zeros(B, H, 1, D + 1)), "key head dim"),
]


@pytest.mark.parametrize("kind", ["full", "sliding", "static"])
@pytest.mark.parametrize("name,make,match", BAD_UPDATES, ids=[b[0] for b in BAD_UPDATES])
def test_bad_updates_are_refused_and_change_nothing(kind, name, make, match):
    layer = {"full": FullLayer(), "sliding": SlidingLayer(4), "static": StaticLayer(50)}[kind]
    layer.update(*kv(6))
    before = [t.clone() for t in layer.kv()]
    bad = make()
    if isinstance(bad, torch.Tensor):
        bad = (bad, bad[..., :1].expand(-1, -1, -1, D + 1).contiguous())
    with pytest.raises(CacheError, match=match):
        layer.update(*bad)
    assert layer.seq_length() == 6
    assert all(torch.equal(a, b) for a, b in zip(before, layer.kv()))


@pytest.mark.parametrize("kind", ["full", "sliding", "static"])
def test_bad_operations(kind):
    layer = {"full": FullLayer(), "sliding": SlidingLayer(4), "static": StaticLayer(50)}[kind]
    layer.update(*kv(3))
    with pytest.raises(CacheError, match="crop"):
        layer.crop(-1)
    layer.crop(4)  # past the start empties the layer (transformers' DynamicLayer)
    assert layer.seq_length() == 0 and layer.keys.shape == (2, 2, 0, D) and layer.is_initialized
    layer.update(*kv(3))
    with pytest.raises(CacheError, match=r"\[-2, 2\)"):
        layer.select(torch.tensor([0, 5]))
    with pytest.raises(CacheError, match="repeats"):
        layer.repeat_interleave(0)
    layer.reset()
    assert layer.seq_length() == 0 and layer.kv() is None and layer.nbytes() == {}


def test_static_decode_step_compiles_without_recompiling_per_token():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def step(layer, k, v, q):
        keys, values = layer.update(k, v)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values)

    compiled = torch.compile(step, backend="eager")
    ours, ref = StaticLayer(64), StaticLayer(64)
    prompt = kv(5)[0]
    for layer in (ours, ref):
        layer.update(prompt, prompt)
    for i in range(12):
        k = kv(1, seed=100 + i)[0]
        q = torch.randn(B, H, 1, D)
        out = compiled(ours, k, k, q)
        assert torch.equal(out, step(ref, k, k, q))
    assert counters["stats"]["unique_graphs"] <= 2  # a first graph, then one with the length symbolic
