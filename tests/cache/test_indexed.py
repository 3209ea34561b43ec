"""Attention layers with a side state (issue 31): ``indexed_attention`` (sparse attention's indexer
keys: ``hybrid_models.INDEXED``) and DeepSeek-V4's compressed attention (its compressor state:
``hybrid_models.COMPRESSED``). Each family, built tiny, gives ``DynamicCache``'s tokens with
``TieredCache`` at full precision and with offload, and runs with int4; the side state is exact,
on the model's device, counted by ``nbytes()`` / ``tier_nbytes()``, kept by fork, save / load and
retier, cropped / reordered / selected as transformers does (a compressor state refuses a crop).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from hybrid_models import COMPRESSED, INDEXED, build, decode, generate, ids, prefilled, same
from tiercache import CacheError, TieredCache, plan
from tiercache.cache.compat import cache_arg
from tiercache.cache.compressed_layer import CompressedLayer
from tiercache.cache.indexed_layer import IndexedLayer, IndexerKeys
from tiercache.cache.side_state import WithSideState

Q = {"backend": "native", "bits": 4, "group_size": 4, "residual_length": 4}
V4_OFFLOAD = [{"layer_type": t, "offload": {"device": "cpu"}}  # sliding layers are offloaded only when asked
              for t in ("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")]
POLICIES = {"fp": {"name": "fp"}, "offload": {"name": "cpu", "offload": {"device": "cpu"}, "overrides": []},
            "static": {"name": "static", "storage": "static", "max_length": 32}, "int4": {"name": "int4", "quantize": Q}}


@functools.lru_cache(maxsize=None)
def model(family: str):
    return build(family)


def policy(family: str, name: str) -> dict:
    p = dict(POLICIES[name])
    if name == "offload" and family in COMPRESSED:
        p["overrides"] = V4_OFFLOAD
    return p




def side_layers(cache) -> list[WithSideState]:
    return [layer for layer in cache.layers if isinstance(layer, WithSideState)]


def side_bytes(cache) -> int:
    return sum(layer.side_nbytes() for layer in side_layers(cache))


@pytest.mark.parametrize("family", INDEXED + COMPRESSED)
def test_family_gives_dynamic_cache_tokens_and_runs_int4(family):
    m = model(family)
    ref_cache = DynamicCache(config=m.config)
    want = generate(m, ref_cache)
    for name in POLICIES:
        cache = TieredCache.from_policy(policy(family, name), m.config)
        got = generate(m, cache)
        assert got.shape == want.shape
        if name != "int4":  # lossless: the very tokens
            assert torch.equal(got, want), name
        assert cache.is_sliding == ref_cache.is_sliding and cache.is_linear == ref_cache.is_linear
        assert side_layers(cache) and side_bytes(cache) > 0
        assert sum(cache.nbytes().values()) == sum(cache.tier_nbytes().values())
        assert cache.tier_nbytes().get("device", 0) >= side_bytes(cache)  # the side state stays on the device
        if name == "offload":
            assert cache.tier_nbytes().get("host", 0) > 0  # the K/V went to the host tier
        for ours, theirs in zip(cache.layers, ref_cache.layers):  # transformers' side state, exactly
            if isinstance(ours, IndexedLayer):  # (HY-V4's "shared" indexer layers hold none)
                assert (ours.indexer_keys is None) == (theirs.indexer_keys is None)
                if ours.indexer_keys is not None:
                    assert ours.indexer_keys.shape == theirs.indexer_keys.shape
                    assert torch.equal(ours.indexer_keys, theirs.indexer_keys) or name != "fp"
            if isinstance(ours, CompressedLayer) and name == "fp":
                for attr in ("compressed_kv", "buffer_kv", "overlap_kv"):
                    for k, t in getattr(theirs, attr, {}).items():
                        assert torch.equal(getattr(ours.side.held, attr)[k], t), (attr, k)


def test_deepseek_v4_int4_quantizes_the_windows_and_keeps_the_compressor_state_exact():
    """DeepSeek-V4: int4 applies to the sliding windows (every layer has one, longer than residual + 1),
    never to the compressor state; layer 0's compressor reads the embeddings, so its state after a
    prefill is the same bit for bit under int4 and at full precision."""
    m = model("deepseek_v4")
    caches = {}
    for name in ("fp", "int4"):
        caches[name] = TieredCache.from_policy(POLICIES[name], m.config)
        with torch.no_grad():
            m(ids(9), **cache_arg(caches[name]), use_cache=True)
    assert [layer.policy.quantize is not None for layer in caches["int4"].layers] == [True, True, True]
    assert [layer.policy.compress_rate for layer in caches["int4"].layers] == [2, 4, None]
    fp, q = caches["fp"].layers[0].side.tensors(), caches["int4"].layers[0].side.tensors()
    assert fp.keys() == q.keys() and "compressed_kv.compressor" in fp
    assert all(torch.equal(fp[k], q[k]) and q[k].dtype == torch.float32 for k in fp)
    assert caches["int4"].layers[0].attention.nbytes() != caches["fp"].layers[0].attention.nbytes()





@pytest.mark.parametrize("family", ["deepseek_v32", "qwen4_exp_text", "deepseek_v4"])
def test_fork_save_load_and_retier_keep_the_side_state(family, tmp_path):
    m = model(family)
    cache, nxt = prefilled(m, policy(family, "fp"))
    twin = cache.fork()
    cache.save(tmp_path / "c.safetensors")
    loaded = TieredCache.load(tmp_path / "c.safetensors", m.config, device="cpu")  # (load(device=) moves it too)
    assert all(layer.state_dict()["side_state.device"] == "cpu" for layer in side_layers(loaded))
    moved = cache.fork()
    moved.retier(policy(family, "offload"))
    assert side_bytes(loaded) > 0 and side_bytes(twin) > 0 and side_bytes(moved) > 0
    for a, b in zip(side_layers(cache), side_layers(moved)):  # moved as held
        assert a.side.state_tensors().keys() == b.side.state_tensors().keys()
        assert all(torch.equal(x, y) for x, y in zip(a.side.state_tensors().values(), b.side.state_tensors().values()))
    want = decode(m, cache, nxt)
    for other in (twin, loaded, moved):
        assert same(decode(m, other, nxt), want)
    back = TieredCache.from_policy(POLICIES["int4"], m.config)  # into quantization and back: it runs
    with torch.no_grad():
        m(ids(), **cache_arg(back), use_cache=True)
    back.retier(POLICIES["fp"])
    assert side_bytes(back) > 0 and len(decode(m, back, nxt, 1)) == 1


@pytest.mark.parametrize("family", ["deepseek_v32", "qwen4_exp_text"])
def test_crop_rolls_the_indexer_keys_back_like_dynamic_cache(family):
    m = model(family)
    ours, ref = TieredCache.from_policy(POLICIES["fp"], m.config), DynamicCache(config=m.config)
    with torch.no_grad():
        for c in (ours, ref):
            m(ids(6), **cache_arg(c), use_cache=True)
            c.activate_past_recording()  # (qwen4_exp_text's linear-attention layer rolls back only so)
            m(ids(3, seed=2), **cache_arg(c), use_cache=True)
            c.crop(-2)
    i = next(j for j, layer in enumerate(ours.layers) if isinstance(layer, IndexedLayer))
    assert torch.equal(ours.layers[i].indexer_keys, ref.layers[i].indexer_keys)
    theirs = ref.layers[i].indexer_position_ids
    assert (ours.layers[i].indexer_position_ids is None) == (theirs is None)
    if theirs is not None:
        assert torch.equal(ours.layers[i].indexer_position_ids, theirs)
    nxt = ids(1, seed=3)
    assert same(decode(m, ours, nxt), decode(m, ref, nxt))


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_beam_reorder_and_batch_select_gather_the_side_state(family):
    m = model(family)
    ours, ref = TieredCache.from_policy(POLICIES["fp"], m.config), DynamicCache(config=m.config)
    beams = torch.tensor([1, 1])
    with torch.no_grad():
        for c in (ours, ref):
            m(ids(6, batch=2), **cache_arg(c), use_cache=True)
            c.reorder_cache(beams)
    nxt = ids(1, seed=3, batch=2)
    assert same(decode(m, ours, nxt), decode(m, ref, nxt))
    if family == "deepseek_v32":  # (transformers' DeepSeek-V4 layer selects its sliding K/V only)
        for c in (ours, ref):
            c.batch_select_indices(torch.tensor([0]))
        assert ours.batch_size == 1 and all(layer.side.batch() == 1 for layer in side_layers(ours))
        assert same(decode(m, ours, nxt[:1]), decode(m, ref, nxt[:1]))
    ours.batch_repeat_interleave(2)
    assert all(layer.side.batch() == ours.batch_size for layer in side_layers(ours))


def test_a_compressor_state_refuses_a_crop_and_changes_nothing():
    m = model("deepseek_v4")
    cache, nxt = prefilled(m, POLICIES["fp"])
    twin = cache.fork()
    with pytest.raises(CacheError, match="cannot be rolled back"):
        cache.crop(-1)
    cache.crop(0)  # trimming a sliding window is no rollback
    assert same(decode(m, cache, nxt), decode(m, twin, nxt))


def test_legacy_tuples_are_refused_for_models_with_a_side_state():
    m = model("deepseek_v32")
    cache, _ = prefilled(m, POLICIES["fp"])
    with pytest.raises(CacheError, match="side state"):
        cache.to_legacy()
    with pytest.raises(CacheError, match="side state"):
        TieredCache.from_legacy((), POLICIES["fp"], m.config)


def test_overrides_name_side_state_layers_as_attention_layers_and_plans_run():
    m = model("qwen4_exp_text")  # layers: linear_attention, indexed_attention
    cache = TieredCache.from_policy({"quantize": Q, "overrides": [{"layer_type": "indexed_attention", "quantize": None}]},
                                    m.config)
    assert cache.layers[1].policy.quantize is None and isinstance(cache.layers[1], IndexedLayer)
    with pytest.raises(Exception, match="not an attention layer"):
        TieredCache.from_policy({"overrides": [{"layers": [0], "quantize": None}]}, m.config)
    for family in ("deepseek_v32", "deepseek_v4"):
        p = plan(POLICIES["int4"], model(family).config, batch_size=1, context_length=64)
        assert p.bytes["device"] > 0
        table = p.table()  # the side state is not planned, and the plan says so rather than count it as 0
        assert "+ side states (not planned)" in table and "keep a side state beside their K/V" in table
    assert "side state" not in plan(POLICIES["int4"], "tiny", batch_size=1, context_length=64).table()


def test_indexer_keys_grow_in_place_and_refuse_another_shape():
    keys = IndexerKeys(chunk=4)
    first = torch.randn(1, 3, 8)
    keys.append(first)
    buffers = set()
    for _ in range(20):  # 23 tokens in 21 appends: 4 buffers (capacity 4, 8, 16, 32), not a copy per append
        keys.append(torch.randn(1, 1, 8))
        buffers.add(keys.tensors()["keys"].data_ptr())
    assert keys.length == 23 and keys.keys.shape == (1, 23, 8) and len(buffers) == 4
    assert torch.equal(keys.keys[:, :3], first)
    with pytest.raises(CacheError, match="width 8"):
        keys.append(torch.randn(1, 1, 4))
    with pytest.raises(CacheError, match=r"\[batch, tokens, index_head_dim\]"):
        keys.append(torch.randn(1, 1, 1, 8))
    keys.crop(5)
    assert keys.keys.shape == (1, 18, 8)
