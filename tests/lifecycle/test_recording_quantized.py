"""A recording quantized sliding layer (assisted decoding on sliding models) through retier, save and load.

Reference: a cache of the target policy fed the same tokens with recording on (what ``retier``
promises: the state such a cache holds, the same next logits, the same roll-backs), and the
full-precision recording cache it came from (the tokens a roll-back needs are still there).
"""

from __future__ import annotations

import pytest
import torch

import builders as models
from lifecycle.policies import feed, next_logits, policy
from tiercache import TieredCache

QUANT = ["int4", "int4-host", "int2-token", "hqq"]


def recording(model, pol: str, ids, tmp_path=None) -> TieredCache:
    cache = TieredCache.from_policy(policy(pol, tmp_path), model.config)
    cache.activate_past_recording()
    next_logits(model, cache, ids)
    return cache


def same_state(a: TieredCache, b: TieredCache) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, x in sa.items():
        y = sb[key]
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, key


@pytest.mark.parametrize("b", QUANT)
def test_retier_into_quantization_keeps_what_a_recording_layer_fed_the_tokens_holds(b):
    model = models.build("mistral")  # every layer slides, window 8
    ids, nxt = models.prompt(1, 30), models.prompt(1, 3, seed=4)
    cache, ref, fp = recording(model, "fp", ids), recording(model, b, ids), recording(model, "fp", ids)
    cache.retier(policy(b))
    assert all(cache.is_recording_past(i) for i in range(len(cache.layers)))
    for x, y in zip(cache.layers, ref.layers):
        (k, v, s), (k2, v2, s2) = x.export(), y.export()
        assert s == s2 == 30 and k.shape[2] == 30  # every recorded token, not only the window
        assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(x.keys, y.keys)
    same_state(cache, ref)
    logits = next_logits(model, cache, nxt)
    assert torch.equal(logits, next_logits(model, ref, nxt))
    assert torch.allclose(logits, next_logits(model, fp, nxt), atol=0.05)  # within quantization error
    for c in (cache, ref, fp):
        c.crop(-23)  # back to 10 tokens, before the window of the 33 seen: only recorded tokens allow it
    assert cache.get_seq_length() == ref.get_seq_length() == fp.get_seq_length() == 10
    logits = next_logits(model, cache, nxt)
    assert torch.equal(logits, next_logits(model, ref, nxt))
    assert torch.allclose(logits, next_logits(model, fp, nxt), atol=0.05)  # within quantization error of full precision


@pytest.mark.parametrize("b", ["int4", "int4-host"])
@pytest.mark.parametrize("before", [[20], [20, 7], [3]], ids=["20", "20-7", "3"])
def test_recording_begun_after_the_window_filled(before, b):
    """Recording switched on mid-way: the blocks a fed layer kept when it began, and every one
    since. Only blocks reaching before the given tokens (padded, before the window: never
    attended) may differ from a fed layer's, as without recording."""
    model = models.build("mistral")
    caches = []
    for pol in ("fp", b):
        c = TieredCache.from_policy(policy(pol), model.config)
        feed(c, before, seed=1)
        c.activate_past_recording()
        feed(c, [7, 1, 3], seed=2)
        caches.append(c)
    cache, ref = caches
    given = [layer.export()[0].shape[2] for layer in cache.layers]
    cache.retier(policy(b))
    g = cache.policy.quantize.group_size
    for x, y, n in zip(cache.layers, ref.layers, given):
        (k, v, s), (k2, v2, s2) = x.export(), y.export()
        assert s == s2 and k.shape == k2.shape and x.keys.shape == y.keys.shape
        exact = -(-(k.shape[2] - n) // g) * g if k.shape[2] > n else 0  # blocks with a padded head
        assert torch.equal(k[:, :, exact:], k2[:, :, exact:]) and torch.equal(v[:, :, exact:], v2[:, :, exact:])
    for c in (cache, ref):
        c.crop(-10)  # a roll-back over recorded tokens
    for x, y in zip(cache.layers, ref.layers):
        assert x.seq_length() == y.seq_length() and x.keys.shape == y.keys.shape
        assert torch.equal(x.keys[:, :, -3:], y.keys[:, :, -3:])


@pytest.mark.parametrize("pol", ["int4", "int4-disk"])
def test_save_and_load_of_a_recording_quantized_sliding_cache(pol, tmp_path):
    model = models.build("mistral")
    ids, nxt = models.prompt(1, 30), models.prompt(1, 3, seed=4)
    cache = recording(model, pol, ids, tmp_path)
    cache.save(tmp_path / "c.tc")
    loaded = TieredCache.load(tmp_path / "c.tc", model.config)
    assert all(loaded.is_recording_past(i) for i in range(len(loaded.layers)))
    same_state(loaded, cache)
    for c in (cache, loaded):
        c.crop(-23)
    assert torch.equal(next_logits(model, loaded, nxt), next_logits(model, cache, nxt))
