"""A quantized layer with attention sinks exports every token it holds, sinks first: ``to_legacy``
is whole, and a retier out of a sinks policy gives the tokens the cache held (the sinks exact)."""

from __future__ import annotations

import torch

import builders as models
from lifecycle.policies import filled, next_logits, policy
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg

SINKS = {"name": "int4-sinks", "quantize": {"bits": 4, "group_size": 4, "residual_length": 6, "sink_tokens": 3}}


def _reference(model, ids):
    from transformers import DynamicCache

    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_arg(ref))
    return ref


def test_export_and_to_legacy_hold_every_token_sinks_first():
    model = models.build("llama")
    ids = models.prompt(1, 30)
    cache, ref = filled(model, SINKS, ids), _reference(model, ids)
    legacy = cache.to_legacy()
    for i, (k, v) in enumerate(legacy):
        want_k, want_v = ref.layers[i].keys, ref.layers[i].values
        assert k.shape == want_k.shape and v.shape == want_v.shape  # 30 tokens, not 30 - 3
        assert torch.equal(k[:, :, :3], want_k[:, :, :3]) and torch.equal(v[:, :, :3], want_v[:, :, :3])  # sinks exact
        assert torch.equal(k, cache.layers[i].keys) and torch.equal(v, cache.layers[i].values)  # what attention reads
        assert (k - want_k).abs().max() < 0.5


def test_retier_out_of_sinks_keeps_what_the_cache_held():
    model = models.build("llama")
    ids, nxt = models.prompt(1, 30), models.prompt(1, 3, seed=4)
    cache = filled(model, SINKS, ids)
    held = [layer.export() for layer in cache.layers]
    cache.retier(policy("fp"))  # out of quantization: exactly the dequantized values it held
    for layer, (k, v, s) in zip(cache.layers, held):
        k2, v2, s2 = layer.export()
        assert s2 == s == 30 and torch.equal(k2, k) and torch.equal(v2, v)
    from_legacy = TieredCache.from_legacy(tuple((k, v) for k, v, _ in held), policy("fp"), model.config)
    assert torch.equal(next_logits(model, cache, nxt), next_logits(model, from_legacy, nxt))


def test_retier_sinks_to_int2_is_accepted():
    model = models.build("llama")
    ids = models.prompt(1, 30)
    cache = filled(model, SINKS, ids)
    cache.retier(policy("int2-token"))
    assert cache.get_seq_length() == 30 and all(layer.export()[2] == 30 for layer in cache.layers)
