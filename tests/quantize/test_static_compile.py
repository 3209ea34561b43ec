"""The static quantized cache under ``torch.compile``: one decode graph, the dynamic int4 cache's numbers.

``CompileableCache`` (``tiercache.cache.compileable``) with ``StaticQuantized`` layers
(``tiercache.quantize.static_layer``) is compared with the dynamic ``TieredCache`` of the same
quantize section: the K/V a layer hands attention (bit-equal, eager), and greedy ``generate``
through transformers' automatic compilation (``compile_config``: ``fullgraph=True``,
``error_on_recompile``) with a backend that counts its graphs. The prefill runs eagerly
(transformers' ``generate`` compiles the decode calls only), so one graph is the decode step. Most
runs use a counting eager backend (the graph capture is what is checked); one runs inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import CompileConfig

from builders import build, prompt
from tiercache import CacheError, PolicyError, TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.cache.compileable import CompileableCache
from tiercache.models.load import load_model
from tiercache.models.tiny import eval_ids
from tiercache.quantize.static_layer import StaticQuantized
from tests.compile_counting import Counting

QUANT = [
    pytest.param({"bits": 4, "group_size": 32, "residual_length": 64}, id="int4"),
    pytest.param({"bits": 2, "group_size": 16, "residual_length": 32, "key_axis": "token", "key_gain": 1.2,
                  "value_bits": 4}, id="int2-keys-per-token-gain"),
]


def compiled_generate(model, ids, cache, new: int, backend):
    cc = CompileConfig(fullgraph=True, backend=backend, dynamic=False)
    cc._compile_all_devices = True  # transformers compiles on CPU only when asked
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        out = model.generate(ids, **cache_arg(cache), max_new_tokens=new, do_sample=False, compile_config=cc,
                             output_logits=True, return_dict_in_generate=True)
    assert not torch._dynamo.utils.counters["graph_break"]
    return out


def dynamic_generate(model, ids, q, new: int):
    cache = TieredCache.from_policy({"name": "dyn", "quantize": q}, model.config)
    with torch.no_grad():
        return model.generate(ids, **cache_arg(cache), max_new_tokens=new, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)


def static_policy(q, max_length: int) -> dict:
    return {"name": "static", "storage": "static", "max_length": max_length, "quantize": q}


def assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("q", QUANT)
def test_tiny_model_decode_compiles_once_and_matches_dynamic(q):
    model, tok = load_model("tiny")
    ids = eval_ids(tok, 40)[None]  # [1, 40]; 90 new tokens: the residual flushes at 64 and 128 (int4), 3x more (int2)
    backend = Counting()
    out = compiled_generate(model, ids, CompileableCache.from_policy(static_policy(q, 160), model.config), 90, backend)
    assert backend.graphs == 1  # the decode step; the prefill ran eagerly
    assert_same(out, dynamic_generate(model, ids, q, 90))


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_other_families_match_dynamic(family):
    model = build(family)
    q = QUANT[0].values[0]
    ids = prompt(length=30)
    backend = Counting()
    out = compiled_generate(model, ids, CompileableCache.from_policy(static_policy(q, 128), model.config), 70, backend)
    assert backend.graphs == 1
    assert_same(out, dynamic_generate(model, ids, q, 70))


@pytest.mark.slow(seconds=30)  # an inductor compile (~28 s on two busy cores)
def test_inductor_tokens_match_dynamic():
    """One real compilation (inductor: the dequantize fused into the step), greedy tokens equal."""
    model, tok = load_model("tiny")
    q = QUANT[0].values[0]
    ids = eval_ids(tok, 50)[None]
    cache = CompileableCache.from_policy(static_policy(q, 96), model.config)
    out = compiled_generate(model, ids, cache, 30, "inductor")  # a flush at 64
    ref = dynamic_generate(model, ids, q, 30)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # measured 3.8e-6 (inductor fuses the dequantize)


def test_full_precision_static_layers_compile_once_too():
    model, tok = load_model("tiny")
    ids = eval_ids(tok, 20)[None]
    backend = Counting()
    cache = CompileableCache.from_policy({"name": "s", "storage": "static", "max_length": 64}, model.config)
    out = compiled_generate(model, ids, cache, 30, backend)
    assert backend.graphs == 1
    ref = TieredCache.from_policy({"name": "full"}, model.config)
    with torch.no_grad():
        want = model.generate(ids, **cache_arg(ref), max_new_tokens=30, do_sample=False)
    assert torch.equal(out.sequences, want)


@pytest.mark.parametrize("q", QUANT)
def test_layer_hands_attention_what_the_dynamic_layer_does(q):
    """Eager updates of mixed sizes (prefill, steps, a chunk, steps): the K/V for attention, bit-equal."""
    config = build("llama").config
    dyn = TieredCache.from_policy({"name": "d", "quantize": {**q, "packed_attention": False}}, config)
    sta = CompileableCache.from_policy(static_policy(q, 200), config)
    g = torch.Generator().manual_seed(0)
    seen = 0
    for t in [5] + [1] * 70 + [37] + [1] * 40:
        k, v = (torch.randn(2, 2, t, 16, generator=g) for _ in range(2))  # [B, H, T, D]
        want, got = dyn.update(k, v, 0), sta.update(k, v, 0)
        seen += t
        assert got[0].shape[2] == sta.layers[0].slots >= seen
        assert torch.equal(got[0][:, :, :seen], want[0]) and torch.equal(got[1][:, :, :seen], want[1])
        assert sta.get_seq_length() == seen
    held = sta.layers[0].kv()
    assert torch.equal(held[0], dyn.layers[0].kv()[0]) and torch.equal(held[1], dyn.layers[0].kv()[1])


def test_nbytes_are_the_packed_rows_and_the_residual_ring():
    config = build("llama").config  # 2 kv heads of 16
    cache = CompileableCache.from_policy(static_policy({"bits": 4, "group_size": 32, "residual_length": 64}, 100),
                                         config)
    cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
    layer = cache.layers[0]
    assert isinstance(layer, StaticQuantized) and layer.slots == 128  # whole residuals
    row = 32 * 16 // 2 + 2 * 16 * 4  # int4 codes + fp32 scale and offset per channel (keys) / token (values)
    assert layer.codecs[0].row_bytes == row and layer.codecs[1].row_bytes == 32 * 16 // 2 + 2 * 32 * 4
    assert layer.nbytes() == {"cpu": 2 * 4 * (layer.codecs[0].row_bytes + layer.codecs[1].row_bytes) + 2 * 2 * 64 * 16 * 4}


BAD_POLICIES = [
    pytest.param({"name": "b", "storage": "full", "quantize": {}}, "storage: static", id="storage-full"),
    pytest.param({"name": "b", "storage": "static", "max_length": 64, "quantize": {"format": "fp8"}}, "format 'fp8'",
                 id="fp8"),
    pytest.param({"name": "b", "storage": "static", "max_length": 64, "quantize": {"sink_tokens": 4}}, "sink_tokens",
                 id="sinks"),
    pytest.param({"name": "b", "storage": "static", "max_length": 64, "quantize": {"meta_bits": 8}}, "meta_bits",
                 id="meta8"),
    pytest.param({"name": "b", "storage": "static", "max_length": 64,
                  "quantize": {"group_size": 32, "residual_length": 48}}, "multiple of group_size", id="residual"),
    pytest.param({"name": "b", "storage": "static", "max_length": 64, "offload": {"device": "cpu"}}, "offload",
                 id="offload"),
]


@pytest.mark.parametrize("policy, says", BAD_POLICIES)
def test_unsupported_policies_are_refused_clearly(policy, says):
    with pytest.raises(PolicyError, match=says):
        CompileableCache.from_policy(policy, build("llama").config)


def test_sliding_layers_are_refused():
    with pytest.raises(PolicyError, match="sliding window"):
        CompileableCache.from_policy({"name": "b", "storage": "static", "max_length": 64}, build("mistral").config)


def test_an_eager_update_past_max_length_is_refused():
    cache = CompileableCache.from_policy(static_policy({"group_size": 16, "residual_length": 16}, 40),
                                         build("llama").config)
    cache.update(torch.randn(1, 2, 39, 16), torch.randn(1, 2, 39, 16), 0)
    with pytest.raises(CacheError, match="max_length=40"):
        cache.update(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), 0)
    assert cache.get_seq_length() == 39  # nothing written


def test_a_compiled_step_past_max_length_is_surfaced():
    """A compiled step cannot raise: it clamps its writes and flags; generate's next eager read raises."""
    model, tok = load_model("tiny")
    ids = eval_ids(tok, 20)[None]
    cache = CompileableCache.from_policy(static_policy({"group_size": 16, "residual_length": 16}, 24), model.config)
    cc = CompileConfig(fullgraph=True, backend=Counting(), dynamic=False)
    cc._compile_all_devices = True
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(CacheError, match="ran past max_length=24"):  # 20 + 8 tokens
        model.generate(ids, **cache_arg(cache), max_new_tokens=8, do_sample=False, compile_config=cc)
    with pytest.raises(CacheError, match="ran past max_length=24"):
        cache.get_seq_length()


def test_a_reset_cache_and_a_fresh_one_reuse_the_graph():
    model, tok = load_model("tiny")
    q = QUANT[0].values[0]
    ids = eval_ids(tok, 50)[None]
    backend = Counting()
    cc = CompileConfig(fullgraph=True, backend=backend, dynamic=False)
    cc._compile_all_devices = True
    torch._dynamo.reset()
    cache = CompileableCache.from_policy(static_policy(q, 128), model.config)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for prompt_ids, c in ((ids, cache), (ids[:, :30], "reset"), (ids, "fresh")):
            if c == "reset":
                cache.reset()
            elif c == "fresh":
                cache = CompileableCache.from_policy(static_policy(q, 128), model.config)
            got = model.generate(prompt_ids, **cache_arg(cache), max_new_tokens=10, do_sample=False, compile_config=cc)
            assert torch.equal(got, dynamic_generate(model, prompt_ids, q, 10).sequences)
    assert backend.graphs == 1


def test_crop_within_the_residual_and_reset():
    cache = CompileableCache.from_policy(static_policy({"group_size": 16, "residual_length": 32}, 100),
                                         build("llama").config)
    cache.crop(-3)  # empty: nothing to do
    k = torch.randn(1, 2, 40, 16)
    cache.update(k, k, 0)  # 32 packed, 8 in the residual
    with pytest.raises(CacheError, match="reaches into packed blocks"):
        cache.layers[0].crop(9)
    cache.layers[0].crop(5)
    assert cache.layers[0].seq_length() == 35
    held = cache.layers[0].kv()[0]
    torch.testing.assert_close(held[:, :, 32:], k[:, :, 32:35], rtol=0, atol=0)  # the residual, exact
    cache.layers[0].crop(35)
    assert cache.layers[0].seq_length() == 0
