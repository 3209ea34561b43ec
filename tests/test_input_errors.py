"""Bad input found by probing: each case gets a clear ``PolicyError`` / ``CacheError`` (never a
bare traceback from torch, never a silently wrong cache), and odd-but-valid input works."""

import json

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

import tiercache
from tiercache import CacheError, PolicyError, TieredCache
from tiercache.models.spec import ModelSpec
from tiercache.planner.api import resolve_model
from tiercache.cache.compat import cache_arg

CONFIG = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=128, intermediate_size=128)
POLICIES = {
    "full": {},
    "int4": {"quantize": {"bits": 4, "group_size": 4, "residual_length": 4}},
    "offload": {"offload": {"device": "cpu"}},
    "int4-offload": {"quantize": {"bits": 4, "group_size": 4, "residual_length": 4}, "offload": {"device": "cpu"}},
    "static": {"storage": "static", "max_length": 64},
}


def kv(t: int, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, t, 16, generator=g), torch.randn(batch, 2, t, 16, generator=g)


def test_quantized_cache_works_outside_no_grad():
    """Regression: K/V that require grad made the shared workspace part of a graph, and the next
    step's in-place dequantization raised RuntimeError (addcmul out= with autograd)."""
    from tiercache.models.tiny import tiny_random

    model = tiny_random()
    cache = TieredCache.from_policy("configs/int4-kivi.yaml", model.config)
    ref = DynamicCache(config=model.config)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    out, want = model(ids, **cache_arg(cache)), model(ids, **cache_arg(ref))
    for _ in range(3):
        nxt = want.logits[:, -1:].argmax(-1)
        out, want = model(nxt, **cache_arg(cache)), model(nxt, **cache_arg(ref))
    err = float((out.logits - want.logits).detach().norm() / want.logits.detach().norm())
    assert err < 0.05, err


@pytest.mark.parametrize("name", POLICIES)
def test_a_first_update_of_no_tokens_is_accepted(name):
    """Regression: full / sliding / offload storage raised TypeError on a zero-token first update."""
    cache = TieredCache.from_policy(POLICIES[name], CONFIG)
    k, v = cache.update(*kv(0), 0)
    assert k.shape[2] == 0 or name == "static"
    assert cache.get_seq_length(0) == 0
    cache.update(*kv(3), 0)
    assert cache.get_seq_length(0) == 3


@pytest.mark.parametrize("name", POLICIES)
def test_select_no_rows_then_query(name):
    """Regression: an offloaded layer of batch 0 computed a negative copy length."""
    cache = TieredCache.from_policy(POLICIES[name], CONFIG)
    for i in range(2):
        cache.update(*kv(9, batch=2), i)
    cache.batch_select_indices(torch.tensor([], dtype=torch.long))
    assert cache.is_initialized in (True, False)
    for layer in cache.layers:
        held = layer.kv()
        assert held is None or held[0].shape[0] == 0


@pytest.mark.parametrize("name", ["int4", "int4-offload", "full"])
def test_a_closed_layer_is_empty_and_usable(name):
    """Regression: a quantized layer kept its token count after ``close()``."""
    cache = TieredCache.from_policy(POLICIES[name], CONFIG)
    cache.update(*kv(6), 0)
    cache.layers[0].close()
    assert cache.get_seq_length(0) == 0 and cache.layers[0].kv() is None
    k, _ = cache.update(*kv(1), 0)
    assert k.shape[2] == cache.get_seq_length(0) == 1


@pytest.mark.parametrize("bad", [True, 1.0, "0", None])
def test_layer_idx_must_be_an_int(bad):
    cache = TieredCache.from_policy({}, CONFIG)
    with pytest.raises(CacheError, match="layer_idx must be an int"):
        cache.update(*kv(2), bad)
    assert cache.get_seq_length(0) == 0 and cache.layers[1].kv() is None


@pytest.mark.parametrize("bad", [True, 1.5, None, torch.tensor(-1)])
def test_crop_needs_an_int(bad):
    cache = TieredCache.from_policy({}, CONFIG)
    cache.update(*kv(6), 0)
    with pytest.raises(CacheError, match=r"crop\(.*\): needs an int <= 0"):
        cache.crop(bad)
    assert cache.get_seq_length(0) == 6


@pytest.mark.parametrize("name", POLICIES)
def test_beam_reorder_keeps_the_batch(name):
    cache = TieredCache.from_policy(POLICIES[name], CONFIG)
    cache.update(*kv(9, batch=2), 0)
    with pytest.raises(CacheError, match="reorder: a beam reorder keeps the batch of 2, got 3"):
        cache.reorder_cache(torch.tensor([0, 1, 1]))
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.layers[0].kv()[0].shape[0] == 2


def test_static_too_large_for_memory_is_a_cache_error():
    cache = TieredCache.from_policy({"storage": "static", "max_length": 10**15}, CONFIG)
    with pytest.raises(CacheError, match="static storage: cannot allocate max_length=1000000000000000"):
        cache.update(*kv(2), 0)
    assert cache.get_seq_length(0) == 0


@pytest.mark.parametrize("name", ["int4", "offload"])
def test_reset_frees_the_shared_buffers(name):
    policy = POLICIES[name]
    if "quantize" in policy:  # the dequantization workspace: held by a layer that dequantizes every step
        policy = {**policy, "quantize": {**policy["quantize"], "packed_attention": False}}
    cache = TieredCache.from_policy(policy, CONFIG)
    for t in (9, 1):
        for i in range(2):
            cache.update(*kv(t), i)
    assert cache.shared_nbytes()
    cache.reset()
    assert cache.nbytes() == {}
    cache.update(*kv(9), 0)  # usable again
    assert cache.get_seq_length(0) == 9


@pytest.mark.parametrize("args, match", [
    ((1.5, 100), "batch_size must be an integer >= 1, got 1.5"),
    ((True, 100), "batch_size must be an integer >= 1, got True"),
    ((1, 0), "context_length must be an integer >= 1, got 0"),
    ((1, "100"), "context_length must be an integer >= 1"),
])
def test_plan_sizes_are_checked(args, match):
    with pytest.raises(PolicyError, match=match):
        tiercache.plan({}, CONFIG, *args)


def test_auto_policy_with_context_zero_is_refused():
    auto = {"auto": True, "budget": {"device": "1GiB"}}
    with pytest.raises(PolicyError, match="context_length must be an integer >= 1, got 0"):
        TieredCache.from_policy(auto, CONFIG, context_length=0)


@pytest.mark.parametrize("source", [None, 5, [1], b"name: x"])
def test_load_policy_names_what_a_policy_may_be(source):
    with pytest.raises(PolicyError, match="a policy is a YAML file path, a dict or a Policy"):
        tiercache.load_policy(source)


@pytest.mark.parametrize("text, match", [
    (b"\xff\xfe name: x", "cannot be read as UTF-8"),
    (b"quantize: {bits: 4}\nquantize: null\n", "'quantize' is given twice"),
    (b"overrides:\n  - layers: []\n    quantize: null\n", r"overrides\[0\].layers: an empty list names no layer"),
    (b"offload: {device: disk, path: ''}\n", r"offload.path: an empty path"),
])
def test_policy_file_problems(tmp_path, text, match):
    path = tmp_path / "p.yaml"
    path.write_bytes(text)
    with pytest.raises(PolicyError, match=match):
        tiercache.load_policy(path)


def test_a_directory_is_not_a_policy_file(tmp_path):
    with pytest.raises(PolicyError, match="is a directory"):
        tiercache.load_policy(tmp_path)


GOOD = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}


@pytest.mark.parametrize("change, match", [
    ({"head_dim": 64.5}, "head_dim must be a positive integer, got 64.5"),  # regression: looped forever
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"hidden_size": "256"}, "hidden_size must be a positive integer, got '256'"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers=2"),
    ({"layer_types": ["sliding_attention"] * 2}, "sliding_window .* must be a positive integer, got None"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": -5}, "must be a positive integer, got -5"),
    ({"hidden_size": None}, "neither head_dim nor hidden_size"),
], ids=lambda x: str(x)[:40])
def test_malformed_model_configs(tmp_path, change, match):
    data = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(PolicyError, match=match):
        resolve_model(str(tmp_path))


def test_a_config_json_must_be_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(PolicyError, match="must be a JSON object"):
        resolve_model(str(tmp_path))


def test_the_builtin_tiny_model_plans_offline():
    spec = resolve_model("tiny")
    assert (spec.num_layers, spec.kv_shape(0)) == (4, (2, 64, 64))
    assert resolve_model("tiny-random").kv_shape(0) == spec.kv_shape(0) and spec.name == "tiny"
    assert ModelSpec.from_config(CONFIG).kv_shape(1) == (2, 16, 16)


@pytest.mark.parametrize("quantize", [None, {"bits": 4, "group_size": 2, "residual_length": 2}], ids=["fp", "int4"])
def test_a_static_overflow_is_refused_before_the_first_layer_writes(quantize):
    # Gemma 2: layer 0 slides (never full), layer 1 is static. The forward used to write the new
    # tokens into layer 0 before layer 1 refused them: after the error get_seq_length() said 18
    # while the static layer held 15, so the next forward ran at the wrong positions.
    import builders

    model = builders.build("gemma2")
    cache = TieredCache.from_policy({"storage": "static", "max_length": 16, "quantize": quantize}, model.config)
    with torch.no_grad():
        model(builders.prompt(1, 15), **cache_arg(cache))
        with pytest.raises(CacheError, match="layer 1: static storage is full: it holds 15 of max_length=16"):
            model(builders.prompt(1, 3, seed=6), **cache_arg(cache))
    assert [cache.get_seq_length(i) for i in range(4)] == [15] * 4
    ref = TieredCache.from_policy({"storage": "static", "max_length": 16, "quantize": quantize}, model.config)
    nxt = builders.prompt(1, 1, seed=7)
    with torch.no_grad():
        model(builders.prompt(1, 15), **cache_arg(ref))
        assert torch.equal(model(nxt, **cache_arg(cache)).logits, model(nxt, **cache_arg(ref)).logits)
