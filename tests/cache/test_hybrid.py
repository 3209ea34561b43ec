"""Hybrid and recurrent models (issue 31): every family of ``hybrid_models.HYBRID`` (each causal-LM
family of the installed transformers whose layers are not all attention layers, built tiny)
gives ``DynamicCache``'s tokens with ``TieredCache`` at full precision and with offload, and
runs with int4; the conv / recurrent states are counted by ``nbytes()`` / ``tier_nbytes()``;
lifecycle operations (fork, save / load, retier, crop while recording) keep them; overrides
naming a layer that is not an attention layer are refused, saying so.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from hybrid_models import HYBRID, build, decode, generate, ids, prefilled, same
from tiercache import CacheError, PolicyError, TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.cache.state_layer import StateLayer

Q = {"backend": "native", "bits": 4, "group_size": 4, "residual_length": 4}
POLICIES = {"fp": {"name": "fp"}, "offload": {"name": "cpu", "offload": {"device": "cpu"}},
            "int4": {"name": "int4", "quantize": Q}}


@functools.lru_cache(maxsize=None)
def model(family: str):
    return build(family)




def ref_state_bytes(cache: DynamicCache) -> int:
    """Bytes of the conv / recurrent states transformers' own layers hold."""
    tensors = [t for layer in cache.layers for d in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
               for t in d.values() if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(cache) -> int:
    return sum(layer.state_nbytes() for layer in cache.layers if isinstance(layer, StateLayer))


@pytest.mark.parametrize("family", HYBRID)
def test_family_gives_dynamic_cache_tokens_and_runs_int4(family):
    m = model(family)
    ref_cache = DynamicCache(config=m.config)
    want = generate(m, ref_cache)
    for name, policy in POLICIES.items():
        cache = TieredCache.from_policy(policy, m.config)
        got = generate(m, cache)
        assert got.shape == want.shape
        if name != "int4":  # lossless: the very tokens
            assert torch.equal(got, want), name
        assert cache.is_linear == ref_cache.is_linear and cache.is_sliding == ref_cache.is_sliding
        states = state_bytes(cache)
        assert states == ref_state_bytes(ref_cache)  # (0 for RecurrentGemma, which keeps its states itself)
        assert sum(cache.nbytes().values()) == sum(cache.tier_nbytes().values())
        assert cache.tier_nbytes().get("device", 0) >= states  # the states stay on the model's device





LIFECYCLE = ["jamba", "falcon_h1", "lfm3", "nemotron_h", "mamba"]


@pytest.mark.parametrize("family", LIFECYCLE)
def test_fork_save_load_and_retier_keep_the_states(family, tmp_path):
    m = model(family)
    cache, nxt = prefilled(m, POLICIES["fp"])
    twin = cache.fork()
    cache.save(tmp_path / "c.safetensors")
    loaded = TieredCache.load(tmp_path / "c.safetensors", m.config)
    moved = cache.fork()
    moved.retier(POLICIES["offload"])
    assert state_bytes(loaded) == state_bytes(cache) > 0 if any(cache.is_linear) else True
    want = decode(m, cache, nxt)
    for other in (twin, loaded, moved):
        assert same(decode(m, other, nxt), want)
    back = TieredCache.from_policy(POLICIES["int4"], m.config)  # into quantization and back: it runs
    with torch.no_grad():
        m(ids(), **cache_arg(back), use_cache=True)
    back.retier(POLICIES["fp"])
    assert len(decode(m, back, nxt, 1)) == 1


@pytest.mark.parametrize("family", ["jamba", "lfm3"])
def test_crop_while_recording_rolls_the_states_back_like_dynamic_cache(family):
    m = model(family)
    ours, ref = TieredCache.from_policy(POLICIES["fp"], m.config), DynamicCache(config=m.config)
    with torch.no_grad():
        for c in (ours, ref):
            m(ids(6), **cache_arg(c), use_cache=True)
            c.activate_past_recording()
            m(ids(3, seed=2), **cache_arg(c), use_cache=True)
            c.crop(-2)
    nxt = ids(1, seed=3)
    assert same(decode(m, ours, nxt), decode(m, ref, nxt))


def test_crop_of_a_state_that_does_not_record_is_refused_and_changes_nothing():
    m = model("jamba")
    cache, nxt = prefilled(m, POLICIES["fp"])
    twin = cache.fork()
    with pytest.raises(CacheError, match="recording"):
        cache.crop(-1)
    assert same(decode(m, cache, nxt), decode(m, twin, nxt))


def test_overrides_name_attention_layers_only():
    m = model("jamba")  # layers: mamba, attention, mamba
    assert m.config.layer_types == ["linear_attention", "full_attention", "linear_attention"]
    with pytest.raises(PolicyError, match="layer 0 is a 'linear_attention' layer, not an attention layer.*\\[1\\]"):
        TieredCache.from_policy({"overrides": [{"layers": [0], "quantize": None}]}, m.config)
    with pytest.raises(PolicyError, match="not attention layers"):
        TieredCache.from_policy({"overrides": [{"layer_type": "linear_attention", "offload": None}]}, m.config)
    cache = TieredCache.from_policy({"quantize": Q, "overrides": [{"layers": [1], "quantize": None}]}, m.config)
    assert [lp.quantize for lp in (layer.policy for layer in cache.layers)] == [None, None, None]


def test_state_methods_refuse_layers_without_a_state():
    m = model("jamba")
    cache = TieredCache.from_policy(POLICIES["fp"], m.config)
    with pytest.raises(ValueError, match="keeps no conv / recurrent state"):
        cache.get_conv_state(1)
    with pytest.raises(ValueError, match="tracks no sequence length"):
        cache.get_seq_length(2)
    with pytest.raises(ValueError, match="not attention K/V"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)


def test_legacy_tuples_are_refused_for_models_with_states():
    m = model("jamba")
    cache, _ = prefilled(m, POLICIES["fp"])
    with pytest.raises(CacheError, match=r"layers \[0, 2\] keep conv / recurrent states"):
        cache.to_legacy()
    with pytest.raises(CacheError, match="legacy"):
        TieredCache.from_legacy((), POLICIES["fp"], m.config)
