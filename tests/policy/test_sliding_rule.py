"""One rule for a quantized sliding layer (issue 31), on Gemma 2 (sliding + full) and Mistral (all
sliding) windows smaller and larger than the residual, prompts shorter and longer than the window.

The rule (``Policy.resolve``): a sliding layer keeps its newest tokens exact by the KIVI residual,
as any quantized layer; one whose window fits in the residual (``window - 1 <= residual_length``)
is not quantized at all, so everything it holds is exact after any update. So fresh prefill,
one-token decoding, retier, ingest (``from_legacy``), ``load_state_dict`` (fork) and ``load``
give the same state for the same tokens; where the window fits the residual, retier into the
quantized policy equals a fresh cache bit for bit (the issue's Gemma 2 case: window 48,
residual 64, a 300-token prompt). (That an update of ``T`` tokens leaves the state ``T`` one-token
updates would is the Quantize layer's own property, tested with the layer in tests/quantize.)
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from builders import COMMON
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg

FITS = {"name": "int4-r64", "quantize": {"backend": "native", "bits": 4, "group_size": 16, "residual_length": 64}}
SMALL_R = {"name": "int4-r16", "quantize": {"backend": "native", "bits": 4, "group_size": 16, "residual_length": 16}}
FP = {"name": "fp"}


def model(family: str, window: int):
    torch.manual_seed(0)
    if family == "gemma2":
        cfg = tf.Gemma2Config(num_hidden_layers=2, sliding_window=window, head_dim=16, **COMMON)
        cfg._attn_implementation = "eager"
        return tf.Gemma2ForCausalLM(cfg).eval()
    return tf.MistralForCausalLM(tf.MistralConfig(num_hidden_layers=2, sliding_window=window, **COMMON)).eval()


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def feed(m, cache, ids, step: int | None = None):
    """Run ``ids`` through the cache (all at once, or ``step`` tokens at a time); the last logits."""
    step = step or ids.shape[1]
    for at in range(0, ids.shape[1], step):
        logits = m(ids[:, at:at + step], **cache_arg(cache), use_cache=True).logits[:, -1]
    return logits


@torch.no_grad()
def next_logits(m, cache, nxt: int = 5) -> torch.Tensor:
    return m(torch.tensor([[nxt]]), **cache_arg(cache), use_cache=True).logits[:, -1]


CASES = [  # family, window, policy, prompt length
    pytest.param("gemma2", 48, FITS, 300, id="gemma2-w48-r64-long"),  # the case
    pytest.param("gemma2", 48, FITS, 30, id="gemma2-w48-r64-short"),
    pytest.param("mistral", 24, FITS, 100, id="mistral-w24-r64-long"),
    pytest.param("gemma2", 48, SMALL_R, 300, id="gemma2-w48-r16-long"),
    pytest.param("mistral", 48, SMALL_R, 30, id="mistral-w48-r16-short"),
    pytest.param("mistral", 48, SMALL_R, 130, id="mistral-w48-r16-long"),
]


@pytest.mark.parametrize("family,window,policy,length", CASES)
def test_every_path_gives_the_same_state(family, window, policy, length, tmp_path):
    m = model(family, window)
    ids = tokens(length)
    fresh = TieredCache.from_policy(policy, m.config)
    feed(m, fresh, ids)
    fp = TieredCache.from_policy(FP, m.config)
    feed(m, fp, ids)
    legacy = TieredCache.from_legacy(fp.to_legacy(), policy, m.config, seq_length=length)
    forked = fresh.fork()
    fresh.save(tmp_path / "c.safetensors")
    loaded = TieredCache.load(tmp_path / "c.safetensors", m.config)
    want = next_logits(m, fresh)
    for cache in (forked, loaded):
        assert torch.equal(next_logits(m, cache), want)
    fits = window - 1 <= policy["quantize"]["residual_length"]
    retiered = fp.fork()
    retiered.retier(policy)
    for cache in (retiered, legacy):
        got = next_logits(m, cache)
        if fits:  # the window fits in the residual: bit for bit
            assert torch.equal(got, want)
        else:  # only the oldest, partly visible block may differ (its head was before the window)
            assert torch.allclose(got, want, atol=0.05), (got - want).abs().max()


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_a_window_that_fits_in_the_residual_holds_every_token_exact(family):
    m = model(family, 48)
    ours, fp = TieredCache.from_policy(FITS, m.config), TieredCache.from_policy(FP, m.config)
    feed(m, ours, tokens(300))
    feed(m, fp, tokens(300))
    for mine, ref in zip(ours.layers, fp.layers):
        if ref.is_sliding:
            assert mine.policy.quantize is None
            assert torch.equal(mine.kv()[0], ref.kv()[0]) and torch.equal(mine.kv()[1], ref.kv()[1])
        else:
            assert mine.policy.quantize is not None  # full-attention layers are quantized as the policy says


def test_a_window_larger_than_the_residual_is_quantized_and_keeps_the_kivi_residual_exact():
    m = model("mistral", 48)
    ours, fp = TieredCache.from_policy(SMALL_R, m.config), TieredCache.from_policy(FP, m.config)
    feed(m, ours, tokens(130))
    feed(m, fp, tokens(130))
    layer, ref = ours.layers[0], fp.layers[0]
    assert layer.policy.quantize is not None
    exact = len(layer.residual)  # KIVI: r(130) = 130 mod 16 = 2 newest tokens exact
    assert exact == 130 % 16
    k, _ = layer.kv()
    assert k.shape == ref.kv()[0].shape
    assert torch.equal(k[:, :, -exact:], ref.kv()[0][:, :, -exact:])
    assert not torch.equal(k, ref.kv()[0])  # the older tokens are quantized
