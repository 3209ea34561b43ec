"""Quality metrics are exactly right where they can be computed by hand or another way."""

import math

import pytest
import torch

from tiercache.bench import quality, runner
from tiercache.models import tiny


@pytest.fixture(scope="module")
def model():
    return tiny.tiny_random()


@pytest.fixture(scope="module")
def ids():
    return tiny.eval_ids(tiny.ByteTokenizer(), 48)  # [48]


def test_perplexity_and_agreement_by_hand():
    assert quality.perplexity(torch.full((5,), math.log(4.0))) == pytest.approx(4.0)
    assert quality.agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    assert quality.prefix_match([1, 2, 3, 4], [1, 2, 0, 4]) == 2
    assert quality.prefix_match([1, 2], [1, 2]) == 2


@pytest.mark.parametrize("make", ["dynamic", "tiercache-default"])
def test_fp_cache_decode_matches_no_cache_forward(model, ids, make):
    from transformers import DynamicCache

    from tiercache import TieredCache

    cache = DynamicCache(config=model.config) if make == "dynamic" else TieredCache.from_policy({"name": "fp"}, model.config)
    ref_nll, ref_top1 = quality.reference(model, ids, 32)  # [16], [16]
    nll, top1 = quality.decode_nll(model, cache, ids, 32)
    assert nll.shape == ref_nll.shape == (16,)
    torch.testing.assert_close(nll, ref_nll, rtol=1e-4, atol=1e-4)
    assert quality.perplexity(nll) == pytest.approx(quality.perplexity(ref_nll), rel=1e-4)
    assert quality.agreement(top1, ref_top1) == 1.0


def test_greedy_run_agrees_with_itself(model, ids):
    from transformers import DynamicCache

    a, _, _ = runner.greedy(model, DynamicCache(config=model.config), ids[:32], 8)
    b, _, _ = runner.greedy(model, DynamicCache(config=model.config), ids[:32], 8)
    assert len(a) == 9 and quality.agreement(a, b) == 1.0 and quality.prefix_match(a, b) == 9


def test_kld_is_zero_for_full_precision_and_grows_with_fewer_bits(model, ids):
    from tiercache import TieredCache

    ref = quality.reference_logp(model, ids, 32)  # [16, V]
    klds = {}
    for bits in (None, 8, 2):
        policy = {"name": "q"} if bits is None else {"quantize": {"bits": bits, "group_size": 8, "residual_length": 8}}
        logp = quality.decode_logp(model, TieredCache.from_policy(policy, model.config), ids, 32)
        assert logp.shape == ref.shape
        klds[bits] = float(quality.kld(ref, logp).mean())
    assert klds[None] < 1e-6 and 0 < klds[8] < klds[2]
