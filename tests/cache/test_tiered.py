"""TieredCache inside transformers: a full-precision policy gives exactly DynamicCache's outputs.

Every generation mode on tiny random models of each family (Llama; Mistral, all layers
sliding; Gemma 2/3, alternating sliding and full; Qwen2/3).
"""

import pytest
import torch
from transformers import DynamicCache

from builders import FAMILIES, MORE_FAMILIES, build, prompt
from tiercache import CacheError, TieredCache
from tiercache.cache.compat import cache_arg

FP = {"name": "fp", "storage": "full"}


def both(model, policy=FP):
    return DynamicCache(config=model.config), TieredCache.from_policy(policy, model.config)


def gen(model, cache, ids, **kw):
    torch.manual_seed(0)
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("do_sample", False)
    return model.generate(ids, **cache_arg(cache), **kw)


MODES = {
    "greedy": dict(),
    "sampled": dict(do_sample=True, top_k=20, temperature=0.9),
    "beam": dict(num_beams=3, num_return_sequences=2, max_new_tokens=10),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_dynamic_cache(family, mode):
    model = build(family)
    ids = prompt(2 if mode != "beam" else 1, 14)
    ref, ours = both(model)
    assert torch.equal(gen(model, ours, ids, **MODES[mode]), gen(model, ref, ids, **MODES[mode]))
    assert ours.get_seq_length() == ref.get_seq_length()


@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_generation_matches(family):
    model, assistant = build(family), build(family, seed=3)
    ids = prompt(1, 10)
    ref, ours = both(model)
    kw = dict(assistant_model=assistant, max_new_tokens=20)
    assert torch.equal(gen(model, ours, ids, **kw), gen(model, ref, ids, **kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_matches(family):
    model = build(family)
    ids = prompt(3, 16)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref, ours = both(model)
    out = gen(model, ours, ids, attention_mask=mask)
    assert torch.equal(out, gen(model, ref, ids, attention_mask=mask))


@pytest.mark.parametrize("family", FAMILIES)
def test_manual_loop_logits_are_identical(family):
    model = build(family)
    ids = prompt(2, 11)
    ref, ours = both(model)
    with torch.no_grad():
        a = model(ids, **cache_arg(ref), use_cache=True).logits
        b = model(ids, **cache_arg(ours), use_cache=True).logits
        assert torch.equal(a, b)
        for step in range(12):  # chunks of 1 and 3 tokens
            nxt = a[:, -1:].argmax(-1) if step % 3 else torch.cat([a[:, -1:].argmax(-1)] * 3, dim=1)
            a = model(nxt, **cache_arg(ref), use_cache=True).logits
            b = model(nxt, **cache_arg(ours), use_cache=True).logits
            assert torch.equal(a, b)
    assert ours.get_seq_length() == ref.get_seq_length()


@pytest.mark.parametrize("family", FAMILIES)
def test_continue_from_filled_cache(family):
    model = build(family)
    ids = prompt(1, 9)
    ref, ours = both(model)
    first_ref, first = gen(model, ref, ids, max_new_tokens=6), gen(model, ours, ids, max_new_tokens=6)
    assert torch.equal(first_ref, first)
    follow = torch.cat([first, prompt(1, 5, seed=7)], dim=1)
    assert torch.equal(gen(model, ours, follow, max_new_tokens=8), gen(model, ref, follow, max_new_tokens=8))


def test_crop_and_select_on_the_cache():
    model = build("gemma2")
    ref, ours = both(model)
    ids = prompt(3, 6)
    with torch.no_grad():
        model(ids, **cache_arg(ref))
        model(ids, **cache_arg(ours))
    for cache in (ref, ours):
        cache.crop(-2)
        cache.batch_select_indices(torch.tensor([0, 2]))
    assert ours.get_seq_length() == ref.get_seq_length() == 4
    for i, layer in enumerate(ours.layers):
        k, v = layer.kv()
        assert torch.equal(k, ref.layers[i].keys) and torch.equal(v, ref.layers[i].values)
    with pytest.raises(ValueError, match="positive"):  # transformers 5.x refuses a positive crop too
        ref.crop(2)
    with pytest.raises(CacheError, match=r"crop\(2\): needs an int <= 0.*positive value is not supported"):
        ours.crop(2)
    assert ours.get_seq_length() == 4  # refused: unchanged
    ours.crop(2 - ours.get_seq_length())  # keep the first 2
    assert ours.get_seq_length() == 2
    ours.reset()
    assert ours.get_seq_length() == 0 and ours.nbytes() == {}


def test_plain_update_protocol_and_errors():
    cache = TieredCache.from_policy({}, build("llama").config)
    k = torch.randn(1, 2, 5, 16)
    out_k, out_v = cache.update(k, k, 0)
    assert torch.equal(out_k, k) and cache.get_seq_length(0) == 5 and cache.get_seq_length(1) == 0
    assert cache.nbytes()["cpu"] > 0
    with pytest.raises(CacheError, match="layer_idx 7 is out of range: this cache was built for 3 layers"):
        cache.update(k, k, 7)
    with pytest.raises(CacheError, match="layer 0: kv head count: the layer holds 2, the update has 3"):
        cache.update(torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16), 0)
    with pytest.raises(CacheError, match="floating point"):
        cache.update(k.long(), k.long(), 1)
    assert cache.get_seq_length(0) == 5


def test_static_policy_generates_like_static_cache():
    from transformers import StaticCache

    model = build("llama")
    ids = prompt(1, 10)
    ours = TieredCache.from_policy({"storage": "static", "max_length": 40}, model.config)
    assert ours.is_compileable
    ref = StaticCache(config=model.config, max_cache_len=40)
    assert torch.equal(gen(model, ours, ids, max_new_tokens=20), gen(model, ref, ids, max_new_tokens=20))
    with pytest.raises(CacheError, match="max_length=40"):
        gen(model, ours, torch.cat([ids] * 4, dim=1), max_new_tokens=5)


STATIC_MIXED = [
    pytest.param("mistral", {}, id="mistral-sliding"),
    pytest.param("cohere2", {}, id="cohere2-sliding+full"),
    pytest.param("gemma3", {}, id="gemma3-sliding+full"),
    pytest.param("llama", {"offload": {"device": "cpu"}}, id="llama-offload"),
    pytest.param("qwen2", {"overrides": [{"layers": [0], "offload": {"device": "cpu"}}]}, id="qwen2-one-layer-offload"),
]


@pytest.mark.parametrize("family, extra", STATIC_MIXED)
def test_static_policy_in_a_cache_that_is_not_compileable_matches_dynamic_cache(family, extra):
    """Static layers next to sliding or offloaded ones: transformers drops the SDPA mask on
    one-token steps of a non-compileable cache, so the static layers must not hand attention
    their unused (zero) tail. Regression: they did, and every decode step attended to zeros."""
    model = build(family)
    model.config._attn_implementation = "sdpa"
    ids = prompt(1, 14)  # longer than the window of 8: the sliding layers slide
    ours = TieredCache.from_policy({"storage": "static", "max_length": 48, **extra}, model.config)
    assert not ours.is_compileable
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        a = model(ids, **cache_arg(ours)).logits[:, -1:]
        b = model(ids, **cache_arg(ref)).logits[:, -1:]
        for _ in range(6):  # one-token steps: the ones whose mask is dropped
            nxt = b.argmax(-1)
            a, b = (model(nxt, **cache_arg(c)).logits for c in (ours, ref))
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    assert torch.equal(gen(model, TieredCache.from_policy({"storage": "static", "max_length": 48, **extra}, model.config), ids),
                       gen(model, DynamicCache(config=model.config), ids))


def test_shared_buffers_are_reported_once_and_apart():
    model = build("llama")
    cache = TieredCache.from_policy({"quantize": {"bits": 4, "group_size": 4, "residual_length": 4,
                                                  "packed_attention": False}}, model.config)  # dequantizes: a workspace
    gen(model, cache, prompt(1, 20), max_new_tokens=4)
    shared, total = cache.shared_nbytes(), cache.nbytes()
    per_layer = sum(sum(layer.nbytes().values()) for layer in cache.layers)
    assert shared["cpu"] > 0 and total["cpu"] == per_layer + shared["cpu"]
    assert TieredCache.from_policy({}, model.config).shared_nbytes() == {}


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_families_full_precision_identical_and_tiered_policies_run(family):
    model = build(family)
    ids = prompt(2, 14)
    ref, ours = both(model)
    assert torch.equal(gen(model, ours, ids), gen(model, ref, ids))
    tiered = TieredCache.from_policy("configs/tiered-int4-offload.yaml", model.config)
    out = gen(model, tiered, ids)
    assert out.shape == (2, 30) and tiered.get_seq_length() == 29 and tiered.nbytes()["cpu"] > 0


@pytest.mark.parametrize("policy", [FP, {"quantize": {"bits": 8, "group_size": 2, "residual_length": 2},
                                         "overrides": [{"layer_type": "sliding_attention", "offload": {"device": "cpu"}}]}],
                         ids=["fp", "int8-offloaded-sliding"])
def test_record_past_is_transformers_assignable_attribute(policy):
    """transformers' generate ends a deferred stop with ``layer.record_past = False`` on every
    layer (MPS path). Regression: that replaced our method with a bool, so sliding layers kept
    recording for good and the next ``activate_past_recording()`` raised TypeError."""
    model = build("mistral")  # every layer sliding, window 8
    cache = TieredCache.from_policy(policy, model.config)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        for c in (cache, ref):
            model(prompt(1, 12), **cache_arg(c))
            c.activate_past_recording()
            assert c.is_recording_past(0)
            model(prompt(1, 3, seed=2), **cache_arg(c))
            c.crop(-1)
            for layer in c.layers:
                layer.record_past = False
            assert not c.is_recording_past(0)
            model(prompt(1, 1, seed=3), **cache_arg(c))
        assert [c.get_mask_sizes(1, 0) for c in (cache, ref)] == [ref.get_mask_sizes(1, 0)] * 2
        if not policy:  # a quantized sliding layer holds whole blocks around the window
            assert cache.layers[0].kv()[0].shape[2] == ref.layers[0].keys.shape[2] == 7  # trimmed to window - 1
        cache.activate_past_recording()  # still a method
        assert cache.is_recording_past(0)


@pytest.mark.parametrize("kind", ["fp", "host", "int4", "int4-disk"])
def test_a_closed_cache_is_empty_and_can_be_used_again(kind, tmp_path):
    """``close()`` frees everything; the cache then behaves as a fresh one of its policy."""
    from tiercache.models.spec import ModelSpec

    q = {"bits": 4, "group_size": 4, "residual_length": 4}
    policies = {"fp": {}, "host": {"offload": {"device": "cpu"}}, "int4": {"quantize": q},
                "int4-disk": {"quantize": q, "offload": {"device": "disk", "path": str(tmp_path)}}}
    spec = ModelSpec("closed", 2, ("full_attention",) * 2, kv_heads=2, head_dim=8, dtype="float32")
    used = TieredCache.from_policy({"name": kind, **policies[kind]}, spec)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        used.update(torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), i)
    used.close()
    assert used.get_seq_length() == 0 and sum(used.nbytes().values()) == 0
    fresh = TieredCache.from_policy({"name": kind, **policies[kind]}, spec)
    for t in (9, 1, 1):
        for i in range(2):
            k, v = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
            a, b = used.update(k, v, i), fresh.update(k, v, i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert used.get_seq_length() == fresh.get_seq_length() == 11
    used.close(), fresh.close()
