"""Drop-in compatibility with transformers 5.x caches (issue 10), one regression per defect:

- KV sharing (Gemma 3n / 4): the layers that reuse another layer's K/V are transformers'
  placeholders (crop ignores them, ``is_dummy``, no sequence length of their own);
- every layer has read-only ``keys`` / ``values`` that never change the layer;
- cropping more than is held empties the cache (``DynamicCache.crop(-46)`` on 45 tokens);
  a positive crop is refused, as transformers 5.x refuses it;
- chunked-attention layers keep ``attention_chunk_size`` tokens even when ``sliding_window``
  is set too.
Each compares with transformers' ``DynamicCache`` built from the same config.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from builders import build, prompt
from tiercache import CacheError, TieredCache
from tiercache.cache.compat import cache_arg

Q = {"backend": "native", "bits": 4, "group_size": 2, "residual_length": 4}


def policies(tmp_path) -> dict:
    return {
        "full": {"name": "full"},
        "static": {"name": "static", "storage": "static", "max_length": 128},
        "offload-cpu": {"name": "cpu", "offload": {"device": "cpu"}},
        "offload-disk": {"name": "disk", "offload": {"device": "disk", "path": str(tmp_path)}},
        "int4": {"name": "int4", "quantize": Q},
        "int4-offload": {"name": "int4-cpu", "quantize": Q, "offload": {"device": "cpu"}},
    }


KINDS = ["full", "static", "offload-cpu", "offload-disk", "int4", "int4-offload"]
LOSSY = {"int4", "int4-offload"}
LLAMA = tf.LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)


def kv(t: int, seed: int = 0, b: int = 1, h: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def gemma3n_config(**kw):
    return tf.Gemma3nTextConfig(
        num_hidden_layers=4, num_kv_shared_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        hidden_size=32, activation_sparsity_pattern=[0.0] * 4, **{"layer_types": ["full_attention"] * 4, **kw})


# -- defect 2: KV sharing -----------------------------------------------------------------------
def test_kv_sharing_reuse_layers_ignore_crop_like_transformers():
    cfg = gemma3n_config()
    ours, ref = TieredCache.from_policy({"name": "full"}, cfg), DynamicCache(config=cfg)
    k, v = kv(5)
    for c in (ours, ref):
        c.update(k, v, 0)
        c.update(k, v, 1)
        c.crop(-1)  # the reuse layers 2, 3 hold nothing: placeholders ignore the crop
    assert ours.get_seq_length() == ref.get_seq_length() == 4
    assert ours.is_dummy == ref.is_dummy == [False, False, True, True]
    assert ours.is_sliding == ref.is_sliding
    assert [ours.get_max_length(i) for i in range(4)] == [ref.get_max_length(i) for i in range(4)]
    assert ours.get_mask_sizes(3, 0) == ref.get_mask_sizes(3, 0)
    assert ours.is_initialized == ref.is_initialized
    for i in (2, 3):  # transformers: a placeholder tracks no sequence length (ValueError)
        with pytest.raises(ValueError):
            ref.get_seq_length(i)
        with pytest.raises(CacheError, match=f"layer {i} reuses the K/V of an earlier layer"):
            ours.get_seq_length(i)
        with pytest.raises(CacheError, match="reuses"):
            ours.get_mask_sizes(1, i)
        with pytest.raises(CacheError, match="never writes it"):
            ours.update(k, v, i)
        assert ours.layers[i].keys is None and ref.layers[i].keys is None


@pytest.mark.parametrize("mode", ["assisted", "prompt-lookup"])
def test_kv_sharing_model_assisted_and_prompt_lookup(mode):
    """Both crop the cache after each rejected draft: Gemma 3n used to fail on its reuse layers."""
    model = build("gemma3n")
    kw = {"assistant_model": build("gemma3n", seed=3)} if mode == "assisted" else {"prompt_lookup_num_tokens": 3}
    ids = prompt(1, 10)
    out = {}
    for name, cache in (("ref", DynamicCache(config=model.config)), ("ours", TieredCache.from_policy({}, model.config))):
        torch.manual_seed(0)
        out[name] = model.generate(ids, **cache_arg(cache), max_new_tokens=12, do_sample=False, **kw)
    assert torch.equal(out["ours"], out["ref"])


# -- defect 3: keys / values ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_layers_have_read_only_keys_and_values(kind, tmp_path):
    ours, ref = TieredCache.from_policy(policies(tmp_path)[kind], LLAMA), DynamicCache(config=LLAMA)
    assert ours.layers[0].keys is None and ours.layers[0].values is None  # as an uninitialised DynamicLayer
    assert ref.layers[0].keys is None
    for t, seed in ((9, 1), (1, 2), (1, 3)):
        for i in range(3):
            k, v = kv(t, seed + 10 * i)
            ours.update(k, v, i)
            ref.update(k, v, i)
    for i in range(3):
        for name in ("keys", "values"):
            got, want = getattr(ours.layers[i], name), getattr(ref.layers[i], name)
            assert got.shape == want.shape and got.dtype == want.dtype
            if kind in LOSSY:
                assert (got - want).abs().max() < 0.5 and torch.equal(got[:, :, -1], want[:, :, -1])  # residual exact
            else:
                assert torch.equal(got, want)
    with pytest.raises(AttributeError):
        ours.layers[0].keys = torch.zeros(1)
    ours.crop(-20)  # cropped empty: [B, H, 0, D] as DynamicLayer, not None
    ref.crop(-20)
    assert ours.layers[0].keys.shape == ref.layers[0].keys.shape == (1, 2, 0, 8)
    ours.reset()
    assert ours.layers[0].keys is None and not ours.is_initialized


@pytest.mark.parametrize("kind", ["offload-cpu", "offload-disk", "int4", "int4-offload"])
def test_reading_keys_changes_nothing(kind, tmp_path):
    """No slot evicted, no prefetch, no shared workspace grown: the next step sees the same."""
    cfg = tf.LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    twin = [TieredCache.from_policy(policies(tmp_path / str(n))[kind], cfg) for n in range(2)]
    for c in twin:
        for i in range(4):
            c.update(*kv(13, i), i)
    looked = twin[0]
    before = looked.nbytes(), looked.shared_nbytes()
    slots = [getattr(layer, "slot", None) for layer in looked.layers]
    for layer in reversed(looked.layers):
        assert layer.keys.shape == layer.values.shape == (1, 2, 13, 8)
    assert (looked.nbytes(), looked.shared_nbytes()) == before
    assert [getattr(layer, "slot", None) for layer in looked.layers] == slots
    for i in range(4):  # the same next step on both
        a, b = (c.update(*kv(1, 50 + i), i) for c in twin)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# -- defect 4: crop past what is held --------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_crop_past_the_start_empties_like_dynamic_cache(kind, tmp_path):
    ours, ref = TieredCache.from_policy(policies(tmp_path)[kind], LLAMA), DynamicCache(config=LLAMA)
    for c in (ours, ref):
        c.crop(-3)  # never written: nothing to do
        c.crop(0)
    assert ours.get_seq_length() == ref.get_seq_length() == 0 and not ours.is_initialized
    for i in range(3):
        k, v = kv(45, i)
        ours.update(k, v, i)
        ref.update(k, v, i)
    for c in (ours, ref):
        c.crop(-46)
    assert ours.get_seq_length() == ref.get_seq_length() == 0
    if kind != "static":  # a compileable static cache masks all max_length slots, as StaticCache
        assert ours.get_mask_sizes(2, 0) == ref.get_mask_sizes(2, 0) == (2, 0)
    assert ours.is_initialized == ref.is_initialized
    k, v = kv(3, 9)
    got, want = ours.update(k, v, 0), ref.update(k, v, 0)  # and it goes on from empty
    got = [t[:, :, :3] for t in got] if kind == "static" else got  # static: max_length slots, the tail masked
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_positive_crop_is_refused_as_in_transformers():
    ours, ref = TieredCache.from_policy({}, LLAMA), DynamicCache(config=LLAMA)
    for c in (ours, ref):
        c.update(*kv(6), 0)
    with pytest.raises(ValueError, match="positive"):
        ref.crop(2)
    with pytest.raises(CacheError, match="positive value is not supported"):
        ours.crop(2)
    assert ours.get_seq_length() == 6


def test_sliding_crop_past_start_while_recording():
    """transformers' length goes negative here (a wrong answer); the layer is simply empty."""
    cfg = tf.MistralConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                           sliding_window=4)
    ours, ref = TieredCache.from_policy({}, cfg), DynamicCache(config=cfg)
    for c in (ours, ref):
        c.activate_past_recording()
        c.update(*kv(6), 0)
        c.crop(-2)  # within what was recorded: the same
    assert ours.get_seq_length() == ref.get_seq_length() == 4
    assert torch.equal(ours.layers[0].keys, ref.layers[0].keys)
    ours.crop(-10)
    assert ours.get_seq_length() == 0 and ours.get_mask_sizes(1, 0) == (1, 0)


def test_sliding_crop_past_window_without_recording_is_refused():
    cfg = tf.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                           sliding_window=4)
    ours, ref = TieredCache.from_policy({}, cfg), DynamicCache(config=cfg)
    for c in (ours, ref):
        for i in range(2):
            c.update(*kv(6), i)
    with pytest.raises(RuntimeError):
        ref.crop(-1)
    for n in (1, 5):  # a refused crop changes no layer (all or nothing)
        with pytest.raises(CacheError, match="activate_past_recording"):
            ours.crop(-n)
        assert ours.get_seq_length() == 6
    ours.crop(-7)  # emptying is exact whatever the window dropped (transformers refuses it)
    assert ours.get_seq_length() == 0 and ours.layers[1].keys.shape == (1, 2, 0, 8)


# -- defect 5: chunked attention -----------------------------------------------------------------
def test_chunked_layers_keep_the_chunk_size():
    cfg = tf.Llama4TextConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                              head_dim=8, attention_chunk_size=2, sliding_window=4,
                              layer_types=["sliding_attention", "chunked_attention"])
    ours, ref = TieredCache.from_policy({}, cfg), DynamicCache(config=cfg)
    assert [ours.get_max_length(i) for i in range(2)] == [ref.get_max_length(i) for i in range(2)] == [4, 2]
    assert ours.is_sliding == ref.is_sliding
    for t in (5, 1, 1, 3, 1):
        k, v = kv(t, t)
        for i in range(2):
            assert ours.get_mask_sizes(t, i) == ref.get_mask_sizes(t, i)
            got, want = ours.update(k, v, i), ref.update(k, v, i)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(ours.layers[i].keys, ref.layers[i].keys)
