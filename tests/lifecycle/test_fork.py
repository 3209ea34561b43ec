"""``cache.fork()`` == ``copy.deepcopy(cache)`` == ``copy.copy(cache)``: an independent cache.

Regression (issue 10, defect 1): a deepcopy of an offloaded cache (cpu, disk, int4 + offload)
returned another layer's history, its prefetcher pointing at the original's layers.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig

import builders as models
from lifecycle.policies import POLICIES, feed, policy
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg

CFG = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)


@pytest.mark.parametrize("name", ["host", "disk", "int4-host", "int4-disk"])
@pytest.mark.parametrize("how", ["deepcopy", "copy", "fork"])
def test_issue10_copy_of_an_offloaded_cache_has_its_own_history(name, how, tmp_path):
    c = TieredCache.from_policy(policy(name, tmp_path), LlamaConfig(num_hidden_layers=3, **CFG))
    for i in range(3):
        k = torch.full((1, 2, 3, 8), i + 1.0)
        c.update(k, k, i)
    d = {"deepcopy": copy.deepcopy, "copy": copy.copy, "fork": lambda x: x.fork()}[how](c)
    for i in range(3):
        x = torch.full((1, 2, 1, 8), 9.0)
        out = d.update(x, x, i)[0][0, 0, :, 0]
        assert torch.allclose(out, torch.tensor([i + 1.0] * 3 + [9.0]), atol=0.05), (i, out)
    assert c.get_seq_length() == 3 and d.get_seq_length() == 4


def _config(model: str):
    if model == "llama":
        return LlamaConfig(num_hidden_layers=3, **CFG)
    return Gemma2Config(num_hidden_layers=4, sliding_window=8, head_dim=8, **CFG)


@pytest.mark.parametrize("model", ["llama", "gemma2"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_fork_is_independent_for_every_policy(name, model, tmp_path):
    c = TieredCache.from_policy(policy(name, tmp_path), _config(model))
    feed(c, [11, 1, 1, 3, 1])
    d = c.fork()
    assert d.layers is not c.layers and all(a is not b for a, b in zip(c.layers, d.layers))
    for a, b in zip(c.layers, d.layers):
        ea, eb = a.export(), b.export()
        assert ea[2] == eb[2] and torch.equal(ea[0], eb[0]) and torch.equal(ea[1], eb[1])
    # per layer the same bytes; shared buffers (workspace, mirrors) are the copy's own, made on use
    assert [a.nbytes() for a in c.layers] == [b.nbytes() for b in d.layers]
    assert [a.tier_nbytes() for a in c.layers] == [b.tier_nbytes() for b in d.layers]
    before = [layer.export() for layer in c.layers]
    before = [(k.clone(), v.clone(), s) for k, v, s in before]
    feed(d, [2, 1], seed=5)  # writing to the copy never shows in the original
    for layer, (k, v, s) in zip(c.layers, before):
        k2, v2, s2 = layer.export()
        assert s2 == s and torch.equal(k2, k) and torch.equal(v2, v)
    feed(c, [1], seed=6)  # nor the other way round
    assert d.get_seq_length() == c.get_seq_length() + 2
    # the same next step on a fresh fork and on the original gives the same K/V
    e = c.fork()
    g = torch.Generator().manual_seed(9)
    for i in range(len(c.layers)):
        h, dk, dv = c.model.kv_shape(i)
        k, v = torch.randn(1, h, 1, dk, generator=g), torch.randn(1, h, 1, dv, generator=g)
        a, b = c.update(k, v, i), e.update(k, v, i)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_fork_of_a_disk_cache_copies_files_never_shares_them(tmp_path):
    c = TieredCache.from_policy(policy("disk", tmp_path), _config("llama"))
    feed(c, [20])
    before = set(_files(tmp_path))
    d = c.fork()
    mine = set(_files(tmp_path)) - before
    assert len(mine) == len(before) > 0  # one new file per file of the original
    c.close()
    assert set(_files(tmp_path)) == mine
    feed(d, [1])  # the copy still works with the original's files gone
    assert d.get_seq_length() == 21
    d.close()
    assert _files(tmp_path) == []


def _files(root) -> list[str]:
    return sorted(os.path.join(p, f) for p, _, fs in os.walk(root) for f in fs)


def test_the_copy_prefetcher_knows_only_the_copy_layers(tmp_path):
    c = TieredCache.from_policy(policy("host"), _config("llama"))
    feed(c, [5])
    d = copy.deepcopy(c)
    pc, pd = c._shared.prefetcher, d._shared.prefetcher
    assert pc is not pd
    mine = {id(layer) for layer in d.layers}
    assert {id(ref()) for ref in pd.layers.values()} == mine
    assert not pd.slots  # no mirror carried over: fetched on first use


def test_generate_continues_a_deepcopy_like_the_original():
    model = models.build("llama")
    ids = models.prompt(1, 12)
    for name in ("fp", "int4-host", "disk"):
        prompt_cache = TieredCache.from_policy(policy(name), model.config)
        with torch.no_grad():
            model(ids, **cache_arg(prompt_cache))
        more = torch.cat([ids, models.prompt(1, 4, seed=3)], 1)
        outs = []
        for _ in range(2):  # transformers' prefix-reuse pattern: deepcopy the prompt cache per request
            cache = copy.deepcopy(prompt_cache)
            outs.append(model.generate(more, **cache_arg(cache), max_new_tokens=5, do_sample=False))
        ref = model.generate(more, **cache_arg(prompt_cache), max_new_tokens=5, do_sample=False)
        assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref), name


@pytest.mark.parametrize("quantize", [None, {"bits": 4, "group_size": 2, "residual_length": 4}], ids=["fp", "int4"])
def test_fork_of_an_empty_recording_cache_still_records(quantize):
    """Found by tests/test_differential.py with deepcopy: an empty quantized sliding layer dropped
    its store's recording flag on fork, so the copy's next crop could not roll back."""
    cfg = Gemma2Config(num_hidden_layers=2, sliding_window=4, head_dim=8, **CFG)
    c = TieredCache.from_policy({"quantize": quantize}, cfg)
    c.activate_past_recording()
    d = c.fork()
    assert [d.is_recording_past(i) for i in range(2)] == [c.is_recording_past(i) for i in range(2)] == [True, False]
    for cache in (c, d):
        for t in (3, 3):
            for i in range(2):
                cache.update(*(torch.ones(1, 2, t, 8),) * 2, i)
        cache.crop(-4)  # rolls back past the window: only a recording layer can
    assert d.get_seq_length() == c.get_seq_length() == 2
