"""Attention sinks (``sink_tokens``): the first N tokens returned bit-identical, the rest exactly
as a layer without sinks would quantize the tokens after them; crops into the sinks; sliding
layers ignore them; the planner predicts the bytes exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

import tiercache
from tiercache.cache.chain import Shared
from tiercache.errors import PolicyError
from tiercache.planner.api import plan
from tiercache.policy.schema import QuantizePolicy
from tests.quantize.quantized import quantized

B, H, D = 2, 3, 16
G, R = 16, 32
# (sink_tokens, update sizes): sinks filled inside a prefill, across updates, or never filled
CASES = [(4, [100, 1, 1, 1, 40]), (4, [2, 1, 1, 1, 90, 1]), (0, [70, 1, 5]), (40, [10, 10, 100, 1]),
         (20, [1] * 120), (8, [5])]


def kv(t, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)
    k[..., :1, :] *= 30  # a large first token, as real attention sinks have
    return k.to(dtype), v.to(dtype)


def layer(sinks, bits=2, shared=None, **kind):
    q = QuantizePolicy(bits=bits, group_size=G, residual_length=R, sink_tokens=sinks)
    return quantized(q, shared, **kind)


@pytest.mark.parametrize("sinks,steps", CASES, ids=[f"n{n}-{len(s)}updates" for n, s in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinks_exact_and_the_rest_as_without_them(sinks, steps, dtype):
    with_sinks, plain = layer(sinks, shared=Shared()), layer(0, shared=Shared())
    ks, vs = [], []
    for i, t in enumerate(steps):
        k, v = kv(t, i, dtype)
        ks.append(k), vs.append(v)
        allk, allv = torch.cat(ks, 2), torch.cat(vs, 2)
        ok, ov = with_sinks.update(k, v)
        n = min(sinks, allk.shape[2])
        assert ok.shape == allk.shape and ov.shape == allv.shape
        assert torch.equal(ok[:, :, :n], allk[:, :, :n]) and torch.equal(ov[:, :, :n], allv[:, :, :n])
        # what comes after the sinks: a sink-free layer fed the same tokens after them
        tail = (k[:, :, max(0, n - (allk.shape[2] - t)):], v[:, :, max(0, n - (allk.shape[2] - t)):])
        if tail[0].shape[2]:
            pk, pv = plain.update(*tail)
            assert torch.equal(ok[:, :, n:], pk) and torch.equal(ov[:, :, n:], pv)
    assert with_sinks.seq_length() == sum(steps)
    kk, vv = with_sinks.kv()
    assert torch.equal(kk[:, :, :n], allk[:, :, :n])
    size = allk.element_size()
    assert sum(with_sinks.nbytes().values()) == sum(plain.nbytes().values()) + 2 * B * H * n * D * size


def test_sinks_beat_no_sinks_when_the_first_token_is_an_outlier():
    k, v = kv(200, 0)
    errs = []
    for sinks in (0, 4):
        q = layer(sinks)
        q.update(k, v)
        kk, _ = q.kv()
        errs.append(float((kk - k).square().mean()))
    assert errs[1] < errs[0] / 2, errs  # block 0 no longer spans the outlier


@pytest.mark.parametrize("crop", [1, 3, 4, 30, 150])
def test_crop_into_the_sinks_then_refill(crop):
    """After a crop (into the residual, blocks or sinks), the layer returns what a fresh layer fed
    the kept tokens then the new ones returns, except for re-quantized kept heads of a cut block."""
    k, v = kv(160, 1)
    q = layer(4)
    q.update(k, v)
    q.validate_crop(crop)
    q.crop(crop)
    kept = 160 - crop
    assert q.seq_length() == kept
    k2, v2 = kv(30, 2)
    ok, ov = q.update(k2, v2)
    assert ok.shape[2] == kept + 30
    n = min(4, kept + 30)
    ref = torch.cat([k[:, :, :kept], k2], 2)
    assert torch.equal(ok[:, :, :n], ref[:, :, :n])  # sinks refilled from the new tokens, exact
    assert torch.equal(ok[:, :, kept:], k2)  # the new tokens themselves are in hand


def test_select_and_reorder_reach_the_sinks():
    k, v = kv(100, 3)
    q = layer(4)
    q.update(k, v)
    q.reorder(torch.tensor([1, 0]))
    kk, _ = q.kv()
    assert torch.equal(kk[0, :, :4], k[1, :, :4]) and torch.equal(kk[1, :, :4], k[0, :, :4])
    q.select(torch.tensor([1]))
    kk, _ = q.kv()
    assert kk.shape[0] == 1 and torch.equal(kk[0, :, :4], k[0, :, :4])


def test_sliding_layers_keep_no_sinks():
    q = layer(4, window=50)
    q.update(*kv(120, 4))
    k, v = kv(10, 5)
    ok, _ = q.update(k, v)
    assert len(q.sinks) == 0 and ok.shape[2] == 50 - 1 + 10  # transformers' sliding contract
    assert torch.equal(ok[:, :, -10:], k)


def test_negative_sink_tokens_is_a_policy_error():
    with pytest.raises(PolicyError, match=r"policy.quantize.sink_tokens: must be >= 0, got -1"):
        tiercache.Policy.from_dict({"quantize": {"sink_tokens": -1}})
    with pytest.raises(PolicyError, match=r"policy.quantize.sink_tokens: expected an integer"):
        tiercache.Policy.from_dict({"quantize": {"sink_tokens": "four"}})


CONFIGS = {
    "llama": LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=128, head_dim=16),
    "mistral": MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=128, head_dim=16, sliding_window=40),
}


@pytest.mark.parametrize("tokens", [3, 4, 50, 131, 400])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_plan_equals_nbytes_with_sinks(tokens, model):
    config = CONFIGS[model]
    policy = tiercache.Policy.from_dict({"name": "sinks", "quantize": {
        "bits": 2, "group_size": G, "residual_length": R, "sink_tokens": 4},
        "overrides": [{"layers": [0], "quantize": {"sink_tokens": 9, "bits": 4}}]})
    cache = tiercache.TieredCache.from_policy(policy, config, batch_size=1, context_length=tokens)
    g = torch.Generator().manual_seed(0)
    for t in (tokens - tokens // 3, *[1] * (tokens // 3)):
        for i in range(config.num_hidden_layers):
            cache.update(torch.randn(1, 2, t, 16, generator=g), torch.randn(1, 2, t, 16, generator=g), i)
    p = plan(policy, config, 1, tokens)
    for layer, row in zip(cache.layers, p.layers):
        assert sum(layer.nbytes().values()) == sum(row.bytes.values()), (row, layer.nbytes())
    cache.close()
