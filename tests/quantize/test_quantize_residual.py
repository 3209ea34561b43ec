"""Quantize: the KIVI residual rule, exact residual bytes, the shared workspace, non-finite input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tiercache
from tiercache.cache.chain import Shared
from tiercache.errors import CacheError
from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize.packed_kv import PackedKV
from tests.quantize.quantized import quantized

B, H, D = 2, 2, 8

# (residual_length, group_size): R a multiple of G, R not a multiple, R == G, R < G, R == 0
RULES = [(128, 64), (100, 64), (8, 8), (4, 8), (0, 4), (12, 4)]


def kv(t, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g).to(dtype), torch.randn(B, H, t, D, generator=g).to(dtype)


def layer(r, g, shared=None, packed_attention=True, **kind):
    return quantized(QuantizePolicy(bits=4, group_size=g, residual_length=r, packed_attention=packed_attention),
                     shared, **kind)


def held_by_single_steps(r, g, n):
    """What the residual holds after ``n`` one-token updates: it fills to R, then its whole blocks go."""
    held = 0
    for _ in range(n):
        held += 1
        if held >= r:
            held -= held // g * g
    return held


@pytest.mark.parametrize("r,g", RULES, ids=[f"r{r}-g{g}" for r, g in RULES])
def test_residual_fills_to_r_then_whole_blocks_are_packed(r, g):
    q = layer(r, g)
    packed_before = 0
    for i in range(3 * max(r, g) + 5):
        q.update(*kv(1, i))
        n, held = i + 1, len(q.residual)
        assert held == held_by_single_steps(r, g, n)
        assert held < max(r, g)  # older tokens than the newest max(R, G) - 1 are always quantized
        if n >= max(r, g) and r >= g:
            assert r % g <= held <= r - 1
        packed = q.store.seq_length() if q.stored else 0
        assert packed * g + held == n
        if packed > packed_before:  # a flush happens exactly when the residual reaches R (or a block)
            assert held_by_single_steps(r, g, n - 1) + 1 >= max(r, 1) and held == (held_by_single_steps(r, g, n - 1) + 1) % g
        packed_before = packed


@pytest.mark.parametrize("r,g", RULES, ids=[f"r{r}-g{g}" for r, g in RULES])
@pytest.mark.parametrize("steps", [[300], [37, 1, 1, 200, 61, 1], [1] * 300, [5, 128, 1, 1, 64, 101]], ids=["one", "mixed", "single", "chunks"])
def test_state_depends_on_tokens_seen_not_on_update_sizes(r, g, steps):
    q = layer(r, g)
    for i, t in enumerate(steps):
        q.update(*kv(t, i))
    n = sum(steps)
    assert len(q.residual) == held_by_single_steps(r, g, n)
    assert q.store.seq_length() * g == n - len(q.residual)


def test_3000_token_prompt_packs_46_blocks_keeps_56():
    q = layer(128, 64)
    q.update(*kv(3000, 0))
    assert q.store.seq_length() == 46 and len(q.residual) == 56
    for i in range(71):  # 56 + 71 = 127: still exact
        q.update(*kv(1, i + 1))
    assert len(q.residual) == 127 and q.store.seq_length() == 46
    q.update(*kv(1, 99))  # reaches 128: both blocks packed, the residual is empty
    assert len(q.residual) == 0 and q.store.seq_length() == 48
    assert q.residual.nbytes() == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_bytes_are_exactly_what_it_holds(dtype):
    q = layer(12, 4)
    size = torch.empty((), dtype=dtype).element_size()
    for i, t in enumerate([7, 1, 1, 1, 9, 1, 30, 1, 1]):
        q.update(*kv(t, i, dtype))
        assert sum(q.residual.nbytes().values()) == 2 * B * H * len(q.residual) * D * size
        assert sum(q.nbytes().values()) == sum(q.store.nbytes().values()) + sum(q.residual.nbytes().values())


# -- the shared workspace --------------------------------------------------------------------------

KINDS = [pytest.param({}, id="full"), pytest.param({"window": 6}, id="sliding6"), pytest.param({"max_length": 80}, id="static80")]


@pytest.mark.parametrize("kind", KINDS)
def test_workspace_outputs_equal_fresh_outputs(kind):
    shared = Shared()
    a, b = layer(4, 4, shared, **kind), layer(4, 4, None, **kind)
    for i, t in enumerate([9, 1, 1, 3, 1, 1, 1, 7, 1, 1]):
        k, v = kv(t, i)
        x, y = a.update(k, v), b.update(k, v)
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_layers_of_one_cache_share_one_workspace_and_steps_allocate_none():
    shared = Shared()
    layers = [layer(4, 4, shared) for _ in range(3)]
    for q in layers:
        q.update(*kv(40, 0))
    ptrs = set()
    for step in range(8):
        for i, q in enumerate(layers):
            k, v = q.update(*kv(1, 10 * step + i))
            ptrs.add(k.untyped_storage().data_ptr())
            ptrs.add(v.untyped_storage().data_ptr())
    assert len(ptrs) == 1  # K and V of every layer, every step: one buffer, carved up
    size = 2 * B * H * 256 * D * 4  # 48 tokens rounded up to one chunk of 256, K and V, fp32
    assert shared.workspace_nbytes() == {"cpu": size} and shared.nbytes() == {"cpu": size}
    assert all(sum(q.nbytes().values()) < size for q in layers)  # reported once, by Shared
    fresh = layers[0].kv()  # kv() never hands out the workspace
    assert fresh[0].untyped_storage().data_ptr() not in ptrs


def test_sliding_prefill_longer_than_window_does_not_grow_the_workspace():
    shared = Shared()
    q = layer(4, 4, shared, window=6, packed_attention=False)  # decode steps dequantize into the workspace
    k, _ = q.update(*kv(50, 0))
    assert k.shape[2] == 50 and shared.workspace_nbytes() == {}
    k, _ = q.update(*kv(1, 1))
    assert k.shape[2] == 6 and shared.workspace_nbytes() == {"cpu": 2 * B * H * 256 * D * 4}
    packed = layer(4, 4, Shared(), window=6)  # packed attention: no workspace until a step falls back
    packed.update(*kv(50, 0))
    k, _ = packed.update(*kv(1, 1))
    assert k.shape[2] == 6 and packed.shared.workspace_nbytes() == {}
    k.plain()  # what eager attention does: dequantize, into the workspace (reserved now)
    assert packed.shared.workspace_nbytes() == {"cpu": 2 * B * H * 256 * D * 4}


def test_cache_returns_workspace_views_and_reports_them_once():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=H, head_dim=D, num_hidden_layers=3,
                         vocab_size=64)
    cache = tiercache.TieredCache.from_policy(
        {"name": "q", "quantize": {"bits": 4, "group_size": 4, "residual_length": 4, "packed_attention": False}}, config)
    for i in range(3):
        cache.update(*kv(30, i), i)
    total = cache.nbytes()["cpu"]
    assert total == sum(sum(layer.nbytes().values()) for layer in cache.layers) + cache.workspace_nbytes()["cpu"]
    cache.close()
    assert cache.workspace_nbytes() == {}


# -- non-finite keys / values ----------------------------------------------------------------------

def snapshot(q):
    held = q.kv()
    return (q.seq_length(), len(q.residual), q.store.seq_length() if q.stored else 0, dict(q.nbytes()),
            None if held is None else [t.clone() for t in held])


def same(a, b):
    assert a[:4] == b[:4]
    assert (a[4] is None) == (b[4] is None)
    if a[4] is not None:
        assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))


@pytest.mark.parametrize("where", ["key-nan", "value-inf", "key-neg-inf"])
@pytest.mark.parametrize("t", [1, 3, 9], ids=lambda t: f"update{t}")
def test_non_finite_update_is_refused_and_changes_nothing(where, t):
    q = layer(4, 4, Shared())
    q.update(*kv(7, 0))
    before = snapshot(q)
    k, v = kv(t, 1)
    bad = {"key-nan": float("nan"), "value-inf": float("inf"), "key-neg-inf": float("-inf")}[where]
    (k if where.startswith("key") else v)[1, 0, t - 1, 3] = bad
    with pytest.raises(CacheError, match="non-finite values in keys/values at") as e:
        q.update(k, v)
    msg = str(e.value)
    assert ("keys[batch 1, head 0" if where.startswith("key") else "values[batch 1, head 0") in msg
    assert f"position {7 + t - 1}" in msg and "a whole group of 4 tokens" in msg and "full-precision policy" in msg
    same(snapshot(q), before)
    q.update(*kv(t, 2))  # a finite update still works
    assert q.seq_length() == 7 + t


def test_non_finite_first_update_leaves_the_layer_new():
    q = layer(4, 4)
    k, v = kv(9, 0)
    v[0, 1, 2, 0] = float("nan")
    with pytest.raises(CacheError, match="values\\[batch 0, head 1, token 2"):
        q.update(k, v)
    assert q.seq_length() == 0 and q.kv() is None and q.spec is None and q.codecs is None
    q.update(*kv(3, 1, torch.bfloat16))  # it may still learn another dtype
    assert q.kv()[0].dtype == torch.bfloat16


def test_non_finite_through_the_cache_names_the_layer():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=H, head_dim=D, num_hidden_layers=2,
                         vocab_size=64)
    cache = tiercache.TieredCache.from_policy({"name": "q", "quantize": {"bits": 4, "group_size": 4}}, config)
    k, v = kv(5, 0)
    k[0, 0, 0, 0] = float("inf")
    with pytest.raises(CacheError, match="layer 1: non-finite"):
        cache.update(k, v, 1)
    assert cache.get_seq_length(1) == 0


def test_large_finite_values_are_accepted():
    q = layer(4, 4)
    k, v = kv(9, 0)
    k[0, 0, 0, 0], v[1, 1, 1, 1] = 3e38, -3e38  # max |x| is finite: no false alarm from overflow
    q.update(k, v)
    h = kv(9, 0)[0].half()
    h[0, 0, 0, 0] = 65504.0
    layer(4, 4).update(h, h)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_attention_holds_no_workspace_until_a_step_falls_back(kind):
    """A packed-attention layer's decode steps read the codes and its prefill returns fresh tensors:
    nothing of the context's size is held beside the cache (the plan counts none), and the results
    are those of the workspace path; only a step whose attention reads the K/V reserves it."""
    shared, plain = Shared(), Shared()
    packed, ref = layer(4, 4, shared, **kind), layer(4, 4, plain, packed_attention=False, **kind)
    for i, t in enumerate([40, 1, 1, 3, 1, 20, 1, 1]):
        (k, v), (wk, wv) = packed.update(*kv(t, i)), ref.update(*kv(t, i))
        if isinstance(k, PackedKV):  # what the model's SDPA computes from them
            query = torch.randn(B, H, t, D, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(F.scaled_dot_product_attention(query, k, v),
                                       F.scaled_dot_product_attention(query, wk, wv), rtol=0, atol=1e-5)
        else:
            assert torch.equal(k, wk) and torch.equal(v, wv)
        assert shared.workspace_nbytes() == {}, f"update {i} of {t} tokens reserved the workspace"
    assert plain.workspace_nbytes()  # the dequantizing layer holds one
    k, _ = packed.update(*kv(1, 99))
    assert isinstance(k, PackedKV) and shared.workspace_nbytes() == {}
    k.plain()
    assert shared.workspace_nbytes()


def test_cache_bytes_of_a_packed_int4_cache_are_the_packed_rows_and_the_residual():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=H, head_dim=D, num_hidden_layers=2,
                         vocab_size=64)
    cache = tiercache.TieredCache.from_policy(
        {"name": "q", "quantize": {"bits": 4, "group_size": 4, "residual_length": 4}}, config)
    for t in (300, 1, 1, 1):
        for i in range(2):
            cache.update(*kv(t, i), i)
    assert cache.nbytes()["cpu"] == sum(sum(layer.nbytes().values()) for layer in cache.layers)
    assert cache.workspace_nbytes() == {}
    cache.close()
