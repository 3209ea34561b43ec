"""The step workspace: the decoding rows of a step take one cache write and one attention call per
full-precision layer, their layers lent slots of it.

Reference: each sequence run alone, batch 1, with transformers' own ``DynamicCache`` (plain full
precision) or a cache of its own policy. The batched runs keep one ``StepWorkspace`` across steps,
as the worker does, while sequences start (prefill chunks), decode, end and are replaced (a freed
slot taken by another sequence). Besides the answers, what each cache holds is checked: while lent,
once given back, forked, and after other sequences took its slot."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from tests.builders import build
from tiercache.cache.compat import cache_arg
from tiercache.cache.tiered import TieredCache
from tiercache.layers.full import FullLayer
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
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            out = model(input_ids=torch.tensor([ids[start:start + chunk]], device=device), **cache_arg(cache))
        for _ in range(new):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), **cache_arg(cache))
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

    def spy(self, step, layer, *args, **kwargs):
        seen.append((layer, len(step.rows(layer))))
        return real(self, step, layer, *args, **kwargs)

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


@pytest.mark.cuda
def test_batched_decode_on_cuda_equals_each_sequence_alone(calls):
    """The server's step on a GPU: full-precision rows share the workspace's write and attention
    call, int4 rows keep their own; each sequence's answer is that of it run alone."""
    model = build("llama").to("cuda")
    all_ids = prompts()
    policies = [FULL, INT4, FULL, FULL, INT4]
    caches = [TieredCache.from_policy(p, model.config) for p in policies]
    tokens, logits = staggered(model, all_ids, caches, StepWorkspace())
    for i, ids in enumerate(all_ids):
        own = TieredCache.from_policy(policies[i], model.config)
        ref_tokens, ref_logits = alone(model, ids, PLAN[i][1], own, chunk=CHUNK)
        assert tokens[i] == ref_tokens, i
        for a, b in zip(logits[i], ref_logits):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    assert max(n for _, n in calls) >= 2  # the full-precision rows shared a call on the GPU
    for c in caches:
        assert c.nbytes().get("cpu", 0) == 0 and c.nbytes().get("cuda:0", 0) > 0  # nothing left the GPU


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


class Held:
    """A stand-in for a sequence's cache: ``layers``, a ``FullLayer`` per layer (what ``plan`` reads)."""

    def __init__(self, keys, values):  # [1, Hkv, n, D] each
        self.layers = [FullLayer()]
        self.layers[0].append(keys, values)


@pytest.mark.parametrize("window", [None, 4])
def test_write_and_attend_are_plain_attention_over_each_rows_own_keys(window):
    """Rows of different lengths (a sliding window too) over several steps, slots kept, one dropped
    and its slot given to a newcomer, one crossing the workspace's capacity: each step's write lands
    in every row's own layer (its ``kv()`` is its history plus the new token), and the batched
    attention equals SDPA over that row's own keys."""
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, dim = 2, 6, 8
    ws = StepWorkspace()
    held = {name: torch.randn(2, 1, kv_heads, n, dim, generator=g) for name, n in (("a", 3), ("b", 126), ("c", 9))}
    held["d"] = torch.randn(2, 1, kv_heads, 20, dim, generator=g)
    seqs = {name: Held(t[0], t[1]) for name, t in held.items()}
    for names in (["a", "b", "c"], ["a", "b", "c"], ["b", "a"], ["a", "d", "b"], ["a", "d", "b"]):
        new = torch.randn(2, 1, kv_heads, len(names), dim, generator=g)  # [k/v, 1, Hkv, T, D] packed
        query = torch.randn(1, heads, len(names), dim, generator=g)  # [1, H, T, D] packed
        members = [(name, seqs[name], held[name].shape[3], r) for r, name in enumerate(names)]
        step = ws.plan(members, len(names))
        assert step.rows(0) == tuple(names)
        ws.write(step, 0, new[0], new[1])
        out = ws.attend(step, 0, query, scaling=0.3, window=window)
        for r, name in enumerate(names):
            held[name] = torch.cat([held[name], new[:, :, :, r:r + 1]], dim=3)
            k, v = seqs[name].layers[0].kv()  # the row's own layer: what it was given, the new token last
            torch.testing.assert_close(k, held[name][0], atol=0, rtol=0)
            torch.testing.assert_close(v, held[name][1], atol=0, rtol=0)
            if window is not None:
                k, v = k[:, :, -window:], v[:, :, -window:]
            q = query[0, :, r].view(1, kv_heads, heads // kv_heads, dim)
            want = F.scaled_dot_product_attention(q, k, v, scale=0.3).reshape(heads, dim)
            torch.testing.assert_close(out[r], want, atol=1e-5, rtol=0)
    assert sorted(step.slots.values()) == [0, 1, 2]
    assert held["b"].shape[3] > 128  # it crossed the first capacity: the lent layers followed the regrowth
    lent = seqs["a"].layers[0].buffer.keys
    ws.release(seqs["a"])
    assert seqs["a"].layers[0].buffer.keys is not lent  # memory of its own again, the same tokens
    torch.testing.assert_close(seqs["a"].layers[0].kv()[0], held["a"][0], atol=0, rtol=0)
    assert seqs["c"].layers[0].buffer.keys.untyped_storage().data_ptr() != lent.untyped_storage().data_ptr()
    ws.clear()
    assert ws.nbytes()["workspace"] == 0
    for name in "bd":
        torch.testing.assert_close(seqs[name].layers[0].kv()[1], held[name][1], atol=0, rtol=0)


def _storages(cache) -> set:
    return {t.untyped_storage().data_ptr() for layer in cache.layers for t in layer.kv()}


def test_lent_caches_hold_their_own_tokens_and_keep_them_after_leaving():
    """Each cache, while lent and after it leaves the workspace, holds the K/V its run alone holds;
    a fork of a lent cache is a copy of its own; a cache that has left keeps its tokens while
    newcomers take its slot; anything writing to a lent cache between steps (its own forward, a
    crop) stays consistent with the batched steps."""
    model = build("llama")
    all_ids = prompts(seed=6)
    caches = [TieredCache.from_policy(FULL, model.config) for _ in all_ids]
    ws = StepWorkspace()
    tokens, _ = staggered(model, all_ids, caches, ws)
    refs = []
    for i, ids in enumerate(all_ids):
        ref = DynamicCache()
        alone(model, ids, PLAN[i][1], ref)
        refs.append(ref)
        n = caches[i].get_seq_length()
        for layer, want in zip(caches[i].layers, ref.layers):
            k, v = layer.kv()
            torch.testing.assert_close(k, want.keys[:, :, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(v, want.values[:, :, :n], atol=1e-5, rtol=0)
    # sequences 0 and 2 decode on together (lent), 3 joins; 0 is forked mid-way and its fork run alone
    live = [0, 2, 3]
    space = {t.untyped_storage().data_ptr() for s in ws._spaces.values() for t in (s.keys, s.values)}
    fork = None
    for step in range(6):
        rows = [Row(caches[i], [tokens[i][-1]]) for i in live]
        out = run_rows(model, rows, ws)
        assert not out.failed
        for r, i in enumerate(live):
            tokens[i].append(int(out.logits[r].argmax()))
        if step == 1:
            space = {t.untyped_storage().data_ptr() for s in ws._spaces.values() for t in (s.keys, s.values)}
            assert _storages(caches[0]) <= space  # lent: its layers read slots of the workspace
            fork = caches[0].fork()
            assert not _storages(fork) & space
            fork_tokens = list(tokens[0])
        if step == 2:  # its own forward between two steps: a plain update of the lent layers
            with torch.no_grad():
                out = model(input_ids=torch.tensor([[tokens[3][-1]]]), **cache_arg(caches[3]))
            tokens[3].append(int(out.logits[0, -1].argmax()))
        if step == 3:
            live = [2, 3, 1]  # 0 leaves (its memory its own again), 1 comes back and takes a free slot
            kept = [t.clone() for layer in caches[0].layers for t in layer.kv()]
    assert not _storages(caches[0]) & space
    assert all(torch.equal(a, b) for a, b in zip(kept, [t for layer in caches[0].layers for t in layer.kv()]))
    for i in (0, 1, 2, 3):  # every token so far, fed alone from scratch
        fed = all_ids[i] + tokens[i][:-1]
        ref = DynamicCache()
        with torch.no_grad():
            model(input_ids=torch.tensor([fed]), **cache_arg(ref))
        assert caches[i].get_seq_length() == len(fed)
        for layer, want in zip(caches[i].layers, ref.layers):
            torch.testing.assert_close(layer.kv()[0], want.keys, atol=1e-4, rtol=0)
            torch.testing.assert_close(layer.kv()[1], want.values, atol=1e-4, rtol=0)
    # the fork continues alone as its parent did from the same point
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[fork_tokens[-1]]]), **cache_arg(fork))
    assert int(out.logits[0, -1].argmax()) == tokens[0][len(fork_tokens)]
    caches[2].crop(-2)  # a crop of a lent cache: the next step continues from the shorter history
    tokens[2] = tokens[2][:-2]
    out = run_rows(model, [Row(caches[2], [tokens[2][-1]]), Row(caches[3], [tokens[3][-1]])], ws)
    ref = DynamicCache()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([all_ids[2] + tokens[2]]), **cache_arg(ref)).logits[0, -1]
    torch.testing.assert_close(out.logits[0], want, atol=1e-4, rtol=0)


def test_a_growth_whose_allocation_fails_leaves_the_space_as_it_was(monkeypatch):
    """Growing allocates the new keys and values before replacing either: when the second
    allocation fails (out of memory, here injected), the space still holds its old, matching pair."""
    from tiercache.layers.spec import KVSpec
    from tiercache.serve.workspace import _Space

    spec = KVSpec(batch=1, heads=2, key_dim=8, value_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    space = _Space(spec, slots=2, tokens=128)
    space.keys.normal_()
    before_k, before_v = space.keys.clone(), space.values.clone()
    made = {"n": 0}
    real = torch.Tensor.new_zeros

    def failing(self, *args, **kwargs):
        made["n"] += 1
        if made["n"] == 2:  # the values' allocation
            raise torch.OutOfMemoryError("injected")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_zeros", failing)
    with pytest.raises(torch.OutOfMemoryError):
        space.grow(4, 512)
    monkeypatch.undo()
    assert space.keys.shape == (2, 2, 128, 8) and space.values.shape == (2, 2, 128, 4)
    assert torch.equal(space.keys, before_k) and torch.equal(space.values, before_v)
    space.grow(4, 512)  # and a later growth works
    assert space.keys.shape[:3] == space.values.shape[:3] == (4, 2, 512)
    assert torch.equal(space.keys[:2, :, :128], before_k)


def test_a_fork_of_a_lent_cache_takes_its_own_room_not_the_slots_padding():
    """A short row lent a slot of a workspace padded to a long row: its fork (the ``n`` choices of
    a request) holds the same tokens in the room a cache of its own takes for them (what the same
    cache allocates once it leaves the workspace), not the slot's padded capacity."""
    model = build("llama")
    g = torch.Generator().manual_seed(3)
    long_ids, short_ids = (torch.randint(3, 128, (n,), generator=g).tolist() for n in (700, 20))
    caches = [TieredCache.from_policy(FULL, model.config) for _ in range(2)]
    ws = StepWorkspace()
    out = run_rows(model, [Row(caches[0], long_ids), Row(caches[1], short_ids)], ws)  # prefill: nothing lent
    nxt = [int(t) for t in out.logits.argmax(-1)]
    run_rows(model, [Row(caches[0], [nxt[0]]), Row(caches[1], [nxt[1]])], ws)  # both decode: lent
    slot = ws._spaces[0].keys.shape[2]
    assert slot > 700  # the short row's slot is padded to the long row
    assert all(layer.buffer.capacity == slot for layer in caches[1].layers)  # lent: it reads its slot
    fork = caches[1].fork()
    ws.release(caches[1])  # the parent's tokens in memory of its own: the room a cache of its own takes
    for mine, theirs in zip(fork.layers, caches[1].layers):
        assert mine.buffer.capacity == theirs.buffer.capacity < slot
        assert mine.buffer.capacity >= 21
        assert not mine.buffer.lent and not theirs.buffer.lent
        for a, b in zip(mine.kv(), theirs.kv()):
            assert torch.equal(a, b)
    assert fork.nbytes() == caches[1].nbytes()
    # the fork decodes on as its parent does, and as the same tokens fed alone (plain full precision)
    ref = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([short_ids + [nxt[1]]]), **cache_arg(ref))
        want = model(input_ids=torch.tensor([[5]]), **cache_arg(ref)).logits[0, -1]
        got = model(input_ids=torch.tensor([[5]]), **cache_arg(fork)).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
