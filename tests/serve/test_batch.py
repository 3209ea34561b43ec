"""``run_rows``: one packed forward over several sequences, each against its own ``TieredCache``.

Reference: each sequence run alone, batch 1, through the model's own attention (``sdpa``, or
``eager`` for Gemma) with a cache of the same policy; at full precision also transformers'
``DynamicCache``. The rows are staggered so that prefill chunks and decode tokens share steps, and
prompts are longer than the sliding window (8) of Mistral and Gemma 2."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.builders import build
from tiercache.cache.compat import cache_arg
from tiercache.cache.tiered import TieredCache
from tiercache.serve.batch import Row, run_rows

FULL = {"name": "full"}
POLICIES = [
    pytest.param(FULL, 1e-4, id="full"),
    pytest.param({"name": "int4", "quantize": {"backend": "native", "bits": 4, "group_size": 16,
                                                 "residual_length": 4}}, 1e-3, id="int4"),
    pytest.param({"name": "host", "offload": {"device": "cpu", "prefetch": 1, "pin_memory": False}}, 1e-4,
                 id="offload"),
]
PROMPTS = (5, 13, 22)
NEW = 10
CHUNK = 4


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPTS]


def alone(model, ids, cache, chunk=None):
    """Greedy tokens and the fp32 logits of each, feeding ``ids`` (``chunk`` tokens a forward, as the
    server does: a quantized layer's prefill attends to its earlier chunks quantized), then one token."""
    tokens, logits = [], []
    chunk = chunk or len(ids)
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            out = model(input_ids=torch.tensor([ids[start:start + chunk]]), **cache_arg(cache))
        for _ in range(NEW):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), **cache_arg(cache))
    return tokens, logits


def batched(model, all_ids, caches, fail=None):
    """Every sequence advanced in one ``run_rows`` a step: prefill ``CHUNK`` tokens a step, then decode.
    ``fail``: (sequence, step) whose row raises in its cache update at layer 1."""
    fed, tokens, logits = [0] * len(all_ids), [[] for _ in all_ids], [[] for _ in all_ids]
    failed, step = set(), 0
    while any(len(t) < NEW for i, t in enumerate(tokens) if i not in failed):
        rows, who = [], []
        for i, ids in enumerate(all_ids):
            if len(tokens[i]) >= NEW or i in failed:
                continue
            if fed[i] < len(ids):
                chunk = ids[fed[i]:fed[i] + CHUNK]
                rows.append(Row(caches[i], chunk, sample=fed[i] + len(chunk) == len(ids), position=fed[i]))
                fed[i] += len(chunk)
            else:
                rows.append(Row(caches[i], [tokens[i][-1]], position=fed[i]))
                fed[i] += 1
            who.append(i)
        if fail is not None and fail[1] == step and fail[0] in who:
            broken = caches[fail[0]]
            real = broken.update

            def update(k, v, layer_idx, *args, **kwargs):
                if layer_idx == 1:
                    raise RuntimeError("injected fault")
                return real(k, v, layer_idx, *args, **kwargs)

            broken.update = update
        out = run_rows(model, rows)
        failed |= {who[r] for r in out.failed}
        sampled = 0
        for row, i in zip(rows, who):
            if row.sample:
                if i not in failed:
                    logits[i].append(out.logits[sampled])
                    tokens[i].append(int(out.logits[sampled].argmax()))
                sampled += 1
        step += 1
    return tokens, logits, failed


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("policy, tol", POLICIES)
def test_each_sequence_gets_what_it_gets_alone(family, policy, tol):
    model = build(family)
    all_ids = prompts()
    caches = [TieredCache.from_policy(policy, model.config) for _ in all_ids]
    tokens, logits, failed = batched(model, all_ids, caches)
    assert not failed
    for i, ids in enumerate(all_ids):
        ref_tokens, ref_logits = alone(model, ids, TieredCache.from_policy(policy, model.config), CHUNK)
        assert tokens[i] == ref_tokens, (family, i)
        for a, b in zip(logits[i], ref_logits):
            torch.testing.assert_close(a, b, atol=tol, rtol=0)
        if policy is FULL:  # and against transformers' own cache
            plain_tokens, plain_logits = alone(model, ids, DynamicCache())
            assert tokens[i] == plain_tokens
            for a, b in zip(logits[i], plain_logits):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert caches[i].get_seq_length() == len(ids) + NEW - 1


def test_a_fault_in_one_row_fails_only_that_row():
    model = build("mistral")
    all_ids = prompts(seed=3)
    ref = [alone(model, ids, TieredCache.from_policy(FULL, model.config))[0] for ids in all_ids]
    caches = [TieredCache.from_policy(FULL, model.config) for _ in all_ids]
    tokens, _, failed = batched(model, all_ids, caches, fail=(1, 4))  # sequence 1 mid-prefill, beside the others
    assert failed == {1}
    assert tokens[0] == ref[0] and tokens[2] == ref[2]


def test_rows_need_tokens():
    model = build("llama")
    with pytest.raises(ValueError, match="at least one token"):
        run_rows(model, [Row(TieredCache.from_policy(FULL, model.config), [])])
    with pytest.raises(ValueError, match="at least one row"):
        run_rows(model, [])


def test_the_model_keeps_its_attention_implementation():
    model = build("gemma2")
    before = model.config._attn_implementation
    run_rows(model, [Row(TieredCache.from_policy(FULL, model.config), [5, 6, 7])])
    assert model.config._attn_implementation == before


def test_a_step_that_samples_nothing_projects_no_token_and_stores_the_same_kv():
    """Rows that only feed tokens (a finished request's closing step: its last token's K/V are
    stored, no logits wanted) run the model but not its LM head; their caches hold what a plain
    full-precision run of the same tokens holds."""
    model = build("llama")
    ids = prompts(seed=4)
    caches = [TieredCache.from_policy(FULL, model.config) for _ in ids]
    run_rows(model, [Row(c, i) for c, i in zip(caches, ids)])
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    try:
        out = run_rows(model, [Row(c, [7], sample=False) for c in caches])
    finally:
        hook.remove()
    assert seen == [0]
    assert out.logits.shape == (0, model.config.vocab_size) and not out.failed
    for cache, prompt in zip(caches, ids):
        ref = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt + [7]]), **cache_arg(ref))
        assert cache.get_seq_length() == len(prompt) + 1
        for layer, want in zip(cache.layers, ref.layers):
            torch.testing.assert_close(layer.kv()[0], want.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.kv()[1], want.values, atol=1e-5, rtol=0)


def test_a_rows_attention_mask_is_made_once_per_step_and_attends_as_alone(monkeypatch):
    """A prefill chunk's causal mask (``t x L``) has the same shape and positions at every layer:
    it is made once per step and row, not once per layer, and the logits are still the run alone's."""
    from tiercache.serve import batch as batch_mod

    model = build("llama")
    ids = prompts(seed=5)
    made = []
    real = batch_mod._mask
    monkeypatch.setattr(batch_mod, "_mask", lambda *a: made.append(a[:3]) or real(*a))
    caches = [TieredCache.from_policy(FULL, model.config) for _ in ids]
    run_rows(model, [Row(c, i[:4]) for c, i in zip(caches, ids)])
    made.clear()
    out = run_rows(model, [Row(c, i[4:]) for c, i in zip(caches, ids)])  # chunks after a held prefix
    assert sorted(made) == sorted((len(i) - 4, len(i), 4) for i in ids)  # once per row, not per layer
    for row, prompt in enumerate(ids):
        ref = DynamicCache()
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prompt]), **cache_arg(ref)).logits[0, -1]
        torch.testing.assert_close(out.logits[row], want, atol=1e-4, rtol=0)
