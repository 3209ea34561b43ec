"""Chunked prefill (``tiercache.generate``) against one-shot prefill, on full-precision, quantized,
offloaded and sliding-window caches."""

import pytest
import torch
from transformers import DynamicCache

import tiercache
from builders import build, prompt
from tiercache.cache.compat import cache_arg
from tiercache.errors import CacheError

FP = {"name": "fp"}
INT8 = {"name": "q8", "quantize": {"bits": 8, "group_size": 8, "residual_length": 8}}
OFFLOAD = {"name": "off", "offload": {"device": "cpu"}}
INT4_OFFLOAD = {"name": "q4off", "quantize": {"bits": 4, "group_size": 8, "residual_length": 8},
                "offload": {"device": "cpu"}}

# (family, chunk): Mistral is sliding everywhere (window 8), Gemma 2 alternates sliding and full
GRID = [("llama", 5), ("llama", 1), ("mistral", 3), ("mistral", 11), ("gemma2", 4), ("gemma2", 9)]


def _run(model, ids, cache, chunk=None, new=6):
    kw = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    if chunk is None:
        return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), **kw)
    return tiercache.generate(model, ids, cache, prefill_chunk=chunk, **kw)


def _cache(model, policy):
    return tiercache.TieredCache.from_policy(policy, model.config)


@pytest.mark.parametrize("family, chunk", GRID, ids=[f"{f}-c{c}" for f, c in GRID])
def test_full_precision_chunked_equals_one_shot(family, chunk):
    model, ids = build(family), prompt(2, 23)
    ref = _run(model, ids, DynamicCache(config=model.config))
    for cache in (_cache(model, FP), DynamicCache(config=model.config)):
        out = _run(model, ids, cache, chunk)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits):  # float rounding of other shapes only
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert cache.get_seq_length() == ids.shape[1] + 5  # the last new token is not fed back


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_offloaded_chunked_is_exactly_the_resident_chunked(family):
    model, ids = build(family), prompt(1, 30)
    for resident, offloaded in ((FP, OFFLOAD), (INT8, {**INT8, "offload": {"device": "cpu"}})):
        a = _run(model, ids, _cache(model, resident), 7)
        b = _run(model, ids, _cache(model, offloaded), 7)
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("policy", [INT8, INT4_OFFLOAD], ids=["int8", "int4-offload"])
def test_quantized_chunked_stays_close_to_full_precision(family, policy):
    model, ids = build(family), prompt(1, 40)
    ref = _run(model, ids, DynamicCache(config=model.config))
    out = _run(model, ids, _cache(model, policy), 6)
    first, ref_first = out.logits[0], ref.logits[0]  # the first decode step: after the whole chunked prefill
    err = (first - ref_first).norm() / ref_first.norm()
    assert err < (0.02 if policy is INT8 else 0.25), err
    assert out.sequences.shape == ref.sequences.shape


def test_padded_batch_matches_one_shot():
    model = build("llama")
    ids = prompt(2, 15)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding on the first row
    kw = dict(max_new_tokens=5, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, **cache_arg(DynamicCache(config=model.config)), **kw)
    out = tiercache.generate(model, ids, _cache(model, FP), prefill_chunk=4, attention_mask=mask, **kw)
    assert torch.equal(out, ref)


def test_default_chunk_comes_from_the_plan():
    model, ids = build("llama"), prompt(1, 9)
    cache = _cache(model, FP)
    out = tiercache.generate(model, ids, cache, max_new_tokens=3, do_sample=False)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(DynamicCache(config=model.config)),
                         max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref)
    p = tiercache.plan(cache.policy, model, 1, 12, device="cpu")
    assert p.prefill_chunk == 12  # 2048 capped at the context


@pytest.mark.parametrize("bad, match", [
    (dict(prefill_chunk=0), "prefill_chunk"), (dict(prefill_chunk=2.5), "prefill_chunk"),
    (dict(attention_mask=torch.ones(1, 3)), "attention_mask"),
], ids=["zero", "float", "mask-shape"])
def test_bad_arguments_are_refused_and_leave_the_cache_empty(bad, match):
    model, ids = build("llama"), prompt(1, 9)
    cache = _cache(model, FP)
    with pytest.raises(CacheError, match=match):
        tiercache.generate(model, ids, cache, max_new_tokens=2, **bad)
    assert cache.get_seq_length() == 0


def test_bad_ids_and_a_used_cache_are_refused():
    model, ids = build("llama"), prompt(1, 9)
    with pytest.raises(CacheError, match="input_ids"):
        tiercache.generate(model, ids.float(), _cache(model, FP), prefill_chunk=4)
    with pytest.raises(CacheError, match="no tokens"):
        tiercache.generate(model, ids[:, :0], _cache(model, FP), prefill_chunk=4)
    cache = _cache(model, FP)
    tiercache.generate(model, ids, cache, prefill_chunk=4, max_new_tokens=1)
    with pytest.raises(CacheError, match="empty cache"):
        tiercache.generate(model, ids, cache, prefill_chunk=4, max_new_tokens=1)
