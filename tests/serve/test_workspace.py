"""The step workspace: the decoding rows of a step attend in one call per full-precision layer.

Reference: each sequence run alone, batch 1, with transformers' own ``DynamicCache`` (plain full
precision) or a cache of its own policy. The batched runs keep one ``StepWorkspace`` across steps,
as the worker does, while sequences start (prefill chunks), decode, end and are replaced (a freed
slot taken by another sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from tests.builders import build
from tiercache.cache.tiered import TieredCache
from tiercache.serve.batch import Row, run_rows
from tiercache.serve.workspace import StepWorkspace

FULL = {"name": "full"}
INT4 = {"name": "int4", "quantize": {"backend": "native", "bits": 4, "group_size": 16, "residual_length": 4}}
CHUNK = 8
# (prompt length, new tokens, first step): sequence 1 ends early, sequence 4 arrives after it
PLAN = [(5, 14, 0), (19, 4, 0), (33, 12, 1), (12, 10, 3), (9, 9, 9)]


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n, _, _ in PLAN]


def alone(model, ids, new, cache, chunk=None):
    """Greedy tokens and fp32 logits of one sequence run by itself."""
    tokens, logits = [], []
    chunk = chunk or len(ids)
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            out = model(input_ids=torch.tensor([ids[start:start + chunk]]), cache=cache)
        for _ in range(new):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache)
    return tokens, logits


def staggered(model, all_ids, caches, workspace):
    """Every sequence through ``run_rows`` with one workspace: ``CHUNK`` prompt tokens a step, then one."""
    fed = [0] * len(all_ids)
    tokens, logits = [[] for _ in all_ids], [[] for _ in all_ids]
    step = 0
    while any(len(tokens[i]) < PLAN[i][1] for i in range(len(all_ids))):
        rows, who = [], []
        for i, ids in enumerate(all_ids):
            if step < PLAN[i][2] or len(tokens[i]) >= PLAN[i][1]:
                continue
            if fed[i] < len(ids):
                chunk = ids[fed[i]:fed[i] + CHUNK]
                rows.append(Row(caches[i], chunk, sample=fed[i] + len(chunk) == len(ids), position=fed[i]))
                fed[i] += len(chunk)
            else:
                rows.append(Row(caches[i], [tokens[i][-1]], position=fed[i]))
                fed[i] += 1
            who.append(i)
        out = run_rows(model, rows, workspace)
        assert not out.failed
        sampled = 0
        for row, i in zip(rows, who):
            if row.sample:
                logits[i].append(out.logits[sampled])
                tokens[i].append(int(out.logits[sampled].argmax()))
                sampled += 1
        step += 1
    return tokens, logits


@pytest.fixture
def calls(monkeypatch):
    """Every ``StepWorkspace.attend``: (layer, rows joined)."""
    seen = []
    real = StepWorkspace.attend

    def spy(self, layer, slots, *args, **kwargs):
        seen.append((layer, len(slots)))
        return real(self, layer, slots, *args, **kwargs)

    monkeypatch.setattr(StepWorkspace, "attend", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_decode_equals_each_sequence_alone(family, calls):
    model = build(family)
    all_ids = prompts()
    caches = [TieredCache.from_policy(FULL, model.config) for _ in all_ids]
    ws = StepWorkspace()
    tokens, logits = staggered(model, all_ids, caches, ws)
    for i, ids in enumerate(all_ids):
        ref_tokens, ref_logits = alone(model, ids, PLAN[i][1], DynamicCache())
        assert tokens[i] == ref_tokens, (family, i)
        for a, b in zip(logits[i], ref_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    layers = model.config.num_hidden_layers
    assert calls and all(0 <= layer < layers for layer, _ in calls)
    assert max(n for _, n in calls) >= 3 and min(n for _, n in calls) >= 2  # shared calls, never one row alone
    run_rows(model, [Row(caches[0], [5]), Row(caches[2], [6])], ws)  # two decoding rows: a copy is held
    assert ws.nbytes()["workspace"] > 0
    run_rows(model, [Row(caches[0], [5, 6]), Row(caches[2], [7])], ws)  # one decoding row: its own call
    assert ws.nbytes()["workspace"] == 0  # the copy is dropped


def test_layers_that_cannot_join_keep_their_own_call(calls):
    """A quantized cache beside full-precision ones: it keeps its own attention (its own policy's
    answer), the full-precision ones join and equal their plain runs."""
    model = build("llama")
    all_ids = prompts(seed=2)
    policies = [FULL, INT4, FULL, FULL, INT4]
    caches = [TieredCache.from_policy(p, model.config) for p in policies]
    tokens, logits = staggered(model, all_ids, caches, StepWorkspace())
    for i, (ids, policy) in enumerate(zip(all_ids, policies)):
        ref_cache = DynamicCache() if policy is FULL else TieredCache.from_policy(policy, model.config)
        ref_tokens, ref_logits = alone(model, ids, PLAN[i][1], ref_cache, CHUNK)
        assert tokens[i] == ref_tokens, i
        for a, b in zip(logits[i], ref_logits):
            torch.testing.assert_close(a, b, atol=1e-3 if policy is INT4 else 1e-4, rtol=0)
    assert max(n for _, n in calls) <= 3  # the quantized ones never joined


def test_a_fault_in_the_batched_call_fails_its_rows_and_the_others_go_on(monkeypatch):
    model = build("llama")
    ids = prompts(seed=4)
    caches = [TieredCache.from_policy(FULL, model.config) for _ in range(3)]
    ws = StepWorkspace()
    for cache, p in zip(caches[:2], ids):
        run_rows(model, [Row(cache, p, position=0)], ws)

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(ws, "attend", broken)
    rows = [Row(caches[0], [7]), Row(caches[1], [8]), Row(caches[2], ids[2], position=0)]
    out = run_rows(model, rows, ws)
    assert set(out.failed) == {0, 1}
    ref = alone(model, ids[2], 1, DynamicCache())[1][0]
    torch.testing.assert_close(out.logits[2], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_attend_is_plain_attention_over_each_rows_keys(window):
    """Rows of different lengths (a sliding window too) against SDPA over each row's own keys, over
    several steps: slots kept, one dropped and its slot given to a newcomer."""
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, dim = 2, 6, 8
    ws = StepWorkspace()
    held = {name: torch.randn(2, 1, kv_heads, n, dim, generator=g) for name, n in (("a", 3), ("b", 140), ("c", 9))}
    for names in (["a", "b", "c"], ["a", "b", "c"], ["b", "a"], ["a", "d", "b"]):
        held.setdefault("d", torch.randn(2, 1, kv_heads, 20, dim, generator=g))
        new = torch.randn(2, len(names), kv_heads, dim, generator=g)  # [k/v, R, Hkv, D]
        for r, name in enumerate(names):
            held[name] = torch.cat([held[name], new[:, r, None, :, None]], dim=3)
        query = torch.randn(len(names), heads, dim, generator=g)
        slots = ws.begin(names)  # any object names a sequence
        lengths = [held[n].shape[3] for n in names]
        out = ws.attend(0, slots, lengths, [(held[n][0], held[n][1]) for n in names], new[0], new[1], query,
                        scaling=0.3, window=window)
        for r, name in enumerate(names):
            k, v = held[name][0], held[name][1]  # [1, Hkv, L, D]
            if window is not None:
                k, v = k[:, :, -window:], v[:, :, -window:]
            q = query[r].view(1, kv_heads, heads // kv_heads, dim)
            want = F.scaled_dot_product_attention(q, k, v, scale=0.3).reshape(heads, dim)
            torch.testing.assert_close(out[r], want, atol=1e-5, rtol=0)
    assert sorted(ws.begin(["a", "d", "b"])) == [0, 1, 2]
