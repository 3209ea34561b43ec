"""Bad tensors and impossible operations: a clear ``CacheError``, and the cache exactly as it was.

Every chain of the grid is filled with a valid prefill, then handed, through
``TieredCache.update`` on each of its layers, a tensor that does not fit what the layer holds.
The error must name the layer index and what was expected; ``kv()``, ``seq_length()`` and
``nbytes()`` of every layer must be unchanged, and a following valid update must still match
the full-precision reference. A different device is simulated with ``meta`` tensors.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from kvmodel import CHAINS, DK, DV, H, MAX_LENGTH, Chain, assert_update, same_snapshot, snapshot, tokens
from tiercache.errors import CacheError

B, PREFILL = 2, 7


def _like(batch=B, heads=H, t=1, dk=DK, dv=DV, dtype=torch.float32, device="cpu"):
    return torch.randn(batch, heads, t, dk, dtype=dtype, device=device), torch.randn(batch, heads, t, dv, dtype=dtype, device=device)


# (id, make (key, value) for a cache holding float32 batch B, what the message must say)
BAD = [
    ("rank-3", lambda: (torch.randn(B, H, DK), torch.randn(B, H, DV)), r"key must have rank 4 \[batch, heads, tokens, head_dim\], got shape \(2, 2, 8\)"),
    ("rank-5", lambda: (torch.randn(1, B, H, 1, DK), torch.randn(1, B, H, 1, DV)), "key must have rank 4"),
    ("key-value-tokens", lambda: (_like(t=2)[0], _like(t=1)[1]), "key and value must agree on"),
    ("heads", lambda: _like(heads=H + 1), f"kv head count: the layer holds {H}, the update has {H + 1}"),
    ("key-dim", lambda: _like(dk=DK + 2), f"key head dim: the layer holds {DK}, the update has {DK + 2}"),
    ("value-dim", lambda: _like(dv=DV - 2), f"value head dim: the layer holds {DV}, the update has {DV - 2}"),
    ("dtype", lambda: _like(dtype=torch.float64), "dtype: the layer holds torch.float32, the update has torch.float64"),
    ("integer-dtype", lambda: tuple(t.long() for t in _like()), "key_states must be floating point, got torch.int64"),
    ("device", lambda: _like(device="meta"), "device: the layer (holds|computes on) cpu, the update (has|is on) meta"),
    ("batch", lambda: _like(batch=B + 1), f"batch size \\(use select / repeat_interleave / reorder to change it\\): the layer holds {B}, the update has {B + 1}"),
    ("not-a-tensor", lambda: ([[0.0]], [[0.0]]), "key must be a torch.Tensor"),
]


@pytest.fixture
def tier_dir():
    with tempfile.TemporaryDirectory() as path:
        yield path


def filled(chain: Chain, path: str):
    cache = chain.build(path)
    refs = chain.refs(cache)
    for i, ref in enumerate(refs):
        k, v = tokens(B, PREFILL, chain.dtype, i)
        assert_update(cache.update(k, v, i), ref.update(k, v), ref.out_length())
        ref.sync_packed()
    return cache, refs


def still_works(cache, refs, chain: Chain, t: int = 3) -> None:
    for i, ref in enumerate(refs):
        k, v = tokens(B, t, chain.dtype, 100 + i)
        assert_update(cache.update(k, v, i), ref.update(k, v), ref.out_length())
        ref.sync_packed()
        ref.check_held(cache.layers[i].kv())


@pytest.mark.parametrize("bad,message", [pytest.param(make, msg, id=name) for name, make, msg in BAD])
@pytest.mark.parametrize("chain", [pytest.param(c, id=c.id) for c in CHAINS if c.dtype == torch.float32])
def test_bad_update_is_refused_and_changes_nothing(chain, bad, message, tier_dir):
    cache, refs = filled(chain, tier_dir)
    before = snapshot(cache)
    for i in range(len(cache.layers)):
        with pytest.raises(CacheError, match=f"^layer {i}: {message}"):
            cache.update(*bad(), i)
        assert same_snapshot(before, snapshot(cache)), f"layer {i} changed"
    still_works(cache, refs, chain)
    cache.close()


STATIC = [pytest.param(c, id=c.id) for c in CHAINS if c.storage == "static" and c.window == 5]


@pytest.mark.parametrize("chain", STATIC)
def test_update_past_static_max_length(chain, tier_dir):
    cache, refs = filled(chain, tier_dir)
    before = snapshot(cache)
    left = MAX_LENGTH - PREFILL
    for i in (0, 2):  # the static layers (layer 1 is sliding)
        with pytest.raises(CacheError, match=f"^layer {i}: static storage is full: it holds {PREFILL} of max_length={MAX_LENGTH} "
                                             f"tokens and cannot take {left + 1} more"):
            cache.update(*tokens(B, left + 1, chain.dtype, 9), i)
    assert same_snapshot(before, snapshot(cache))
    still_works(cache, refs, chain, t=left)  # exactly full is fine
    with pytest.raises(CacheError, match="^layer 0: static storage is full"):
        cache.update(*tokens(B, 1, chain.dtype, 9), 0)


# Whole-cache operations with bad arguments: (id, call, message)
BAD_OPS = [
    ("crop-positive", lambda c: c.crop(PREFILL - 1), rf"crop\({PREFILL - 1}\): needs an int <= 0.*a positive value is not supported"),
    ("reorder-out-of-range", lambda c: c.reorder_cache(torch.tensor([0, B])), r"reorder: indices must lie in \[-2, 2\)"),
    ("reorder-2d", lambda c: c.reorder_cache(torch.zeros(2, 2, dtype=torch.long)), "reorder: expected a 1-D integer index tensor"),
    ("reorder-float", lambda c: c.reorder_cache(torch.tensor([0.0, 1.0])), "reorder: expected a 1-D integer index tensor"),
    ("select-mask-length", lambda c: c.batch_select_indices(torch.tensor([True, False, True])), "select: boolean mask has 3 entries, batch is 2"),
    ("repeat-zero", lambda c: c.batch_repeat_interleave(0), r"repeat_interleave\(repeats\) needs an int >= 1, got 0"),
    ("layer-index", lambda c: c.update(*_like(), 3), "layer_idx 3 is out of range: this cache was built for 3 layers"),
]


@pytest.mark.parametrize("op,message", [pytest.param(op, msg, id=name) for name, op, msg in BAD_OPS])
@pytest.mark.parametrize("chain", [pytest.param(c, id=c.id) for c in CHAINS if c.offload in ("resident", "disk-p1")])
def test_bad_operation_is_refused_and_changes_nothing(chain, op, message, tier_dir):
    cache, refs = filled(chain, tier_dir)
    before = snapshot(cache)
    with pytest.raises(CacheError, match=message):
        op(cache)
    assert same_snapshot(before, snapshot(cache))
    still_works(cache, refs, chain)
    cache.close()


SLIDING = [pytest.param(c, id=c.id) for c in CHAINS if c.storage == "full" and c.offload in ("resident", "host-p1")]


@pytest.mark.parametrize("chain", SLIDING)
def test_crop_beyond_the_window_refused_by_whole_cache(chain, tier_dir):
    """The sliding layer cannot roll back past its window: no layer is cropped (all or nothing)."""
    cache = chain.build(tier_dir)
    refs = chain.refs(cache)
    for step, t in enumerate([30, 1, 1]):
        for i, ref in enumerate(refs):
            k, v = tokens(B, t, chain.dtype, 10 * step + i)
            cache.update(k, v, i)
            ref.update(k, v)
            ref.sync_packed()
    before = snapshot(cache)
    with pytest.raises(CacheError, match="^layer 1: .*activate_past_recording"):
        cache.crop(-20)
    assert same_snapshot(before, snapshot(cache)), "a refused crop must leave every layer as it was"
    cache.close()
