"""ModelSpec reads what each layer really caches, and KV-sharing models get owned K/V.

Shapes are checked against what transformers' DynamicCache holds after a forward pass of tiny
random models (multi-query, latent attention, per-layer head dims, KV sharing). KV-sharing
models (Gemma 3n / Gemma 4) keep a ``store`` layer's returned K/V and read them after other
layers have updated the cache: results must match the same model without tiercache's shared
buffers (bit-exact for offload, within quantization error for quantize).
"""

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from tiercache import TieredCache
from tiercache.models.spec import ModelSpec
from tiercache.cache.compat import cache_arg

SMALL = dict(vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def gemma_shared(cls, shared: int = 2, **kw):
    return cls(hidden_size=64, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, intermediate_size=128,
               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=shared, **SMALL, **kw)


CONFIGS = {
    "llama": lambda: tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, **SMALL),
    "falcon-multi-query": lambda: tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  multi_query=True, **SMALL),
    "gpt-bigcode-multi-query": lambda: tf.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, multi_query=True, **SMALL),
    "deepseek-v3-latent": lambda: tf.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
        n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, moe_intermediate_size=32,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, **SMALL),
    "gemma4-per-layer-head-dim": lambda: gemma_shared(tf.Gemma4TextConfig, shared=0, global_head_dim=32),
    "gemma4-kv-shared": lambda: gemma_shared(tf.Gemma4TextConfig, global_head_dim=32),
    "gemma3n-kv-shared": lambda: gemma_shared(tf.Gemma3nTextConfig, laurel_rank=8, altup_num_inputs=2,
                                              activation_sparsity_pattern=[0.0] * 6),
}


def model_of(config):
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def ids(length: int, batch: int = 2, seed: int = 1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_kv_shape_is_what_the_model_caches(name):
    config = CONFIGS[name]()
    model, cache = model_of(config), DynamicCache(config=config)
    with torch.no_grad():
        model(ids(5), **cache_arg(cache))
    spec = ModelSpec.from_config(config)
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if spec.kv_sharing(i) == "reuse":
            assert keys is None or keys.numel() == 0, f"layer {i} reuses another layer's K/V: it caches nothing"
            continue
        assert spec.kv_shape(i) == (keys.shape[1], keys.shape[3], layer.values.shape[3]), f"layer {i}"


def test_kv_sharing_modes_are_read():
    spec = ModelSpec.from_config(CONFIGS["gemma4-kv-shared"]())
    assert [spec.kv_sharing(i) for i in range(6)] == [None, None, "store", "store", "reuse", "reuse"]
    assert ModelSpec.from_config(CONFIGS["llama"]()).kv_sharing_modes is None


def run(model, cache, steps: int = 6):
    """Prefill past the window, then one-token steps; the logits of every step."""
    out = []
    with torch.no_grad():
        out.append(model(ids(20), **cache_arg(cache)).logits)
        for s in range(steps):
            out.append(model(ids(1, seed=10 + s), **cache_arg(cache)).logits)
    return torch.cat(out, dim=1)


OFFLOAD_ALL = {"offload": {"device": "cpu", "prefetch": 0},
               "overrides": [{"layer_type": "sliding_attention", "offload": {"device": "cpu", "prefetch": 0}}]}
INT8 = {"quantize": {"bits": 8, "group_size": 4, "residual_length": 4}}


@pytest.mark.parametrize("name", ["gemma4-kv-shared", "gemma3n-kv-shared"])
def test_kv_sharing_model_offloaded_is_exact(name):
    """Regression: an offloaded ``store`` layer returned views of a prefetch slot that the next
    layers refilled before the ``reuse`` layers read them."""
    model = model_of(CONFIGS[name]())
    want = run(model, DynamicCache(config=model.config))
    assert torch.equal(run(model, TieredCache.from_policy(OFFLOAD_ALL, model.config)), want)


@pytest.mark.parametrize("name", ["gemma4-kv-shared", "gemma3n-kv-shared"])
def test_kv_sharing_model_quantized_error_is_quantization_error(name):
    """Regression: a quantized ``store`` layer returned the shared dequantization workspace,
    overwritten by the next layer before the ``reuse`` layers read it (error ~0.5 instead of ~1e-2)."""
    model = model_of(CONFIGS[name]())
    want = run(model, DynamicCache(config=model.config))
    got = run(model, TieredCache.from_policy(INT8, model.config))
    err = float((got - want).norm() / want.norm())
    assert err < 0.05, err


@pytest.mark.parametrize("policy", [{}, INT8, {"quantize": {"bits": 4, "group_size": 8, "residual_length": 8},
                                             "offload": {"device": "cpu"}}], ids=["fp", "int8", "int4-offload"])
def test_gemma4_generates(policy):
    """Gemma 4's heterogeneous config (per-layer head_dim) builds and generates."""
    model = model_of(CONFIGS["gemma4-kv-shared"]())
    model.generation_config.pad_token_id = 0
    cache = TieredCache.from_policy(policy, model.config)
    with torch.no_grad():
        out = model.generate(ids(12), **cache_arg(cache), max_new_tokens=6, do_sample=False)
        ref = model.generate(ids(12), **cache_arg(DynamicCache(config=model.config)), max_new_tokens=6,
                             do_sample=False)
    assert out.shape == ref.shape
    if not policy:
        assert torch.equal(out, ref)


SEQ2SEQ_SPECS = {  # config -> (decoder layers, (kv heads, key dim, value dim)) of what the decoder caches
    "bart": (lambda: tf.BartConfig(d_model=48, encoder_layers=2, decoder_layers=3, encoder_attention_heads=6,
                                   decoder_attention_heads=4, **SMALL), (3, (4, 12, 12))),
    "t5": (lambda: tf.T5Config(d_model=32, d_kv=6, num_heads=4, num_layers=2, num_decoder_layers=5, **SMALL),
           (5, (4, 6, 6))),
    "whisper": (lambda: tf.WhisperConfig(d_model=48, encoder_layers=4, decoder_layers=2, encoder_attention_heads=6,
                                         decoder_attention_heads=3, **SMALL), (2, (3, 16, 16))),
}


@pytest.mark.parametrize("name", SEQ2SEQ_SPECS)
def test_encoder_decoder_configs_are_read_for_their_decoder(name, tmp_path):
    """transformers maps num_hidden_layers (and Whisper's num_key_value_heads) to the encoder."""
    from tiercache.planner.api import resolve_model

    make, (layers, shape) = SEQ2SEQ_SPECS[name]
    config = make()
    spec = ModelSpec.from_config(config)
    assert (spec.num_layers, spec.kv_shape(0), spec.cross_attention) == (layers, shape, True)
    config.save_pretrained(tmp_path)  # a local config.json, read without transformers' attribute maps
    local = resolve_model(str(tmp_path))
    assert (local.num_layers, local.kv_shape(0), local.cross_attention) == (layers, shape, True)
    assert not ModelSpec.from_config(CONFIGS["llama"]()).cross_attention


def test_composite_configs_read_their_decoder_config():
    """T5Gemma's decoder has GQA and sliding layers of its own: read from config.decoder as a decoder config."""
    mod = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               sliding_window=4)
    config = tf.T5GemmaConfig(encoder=tf.T5GemmaModuleConfig(num_hidden_layers=2, **mod),
                              decoder=tf.T5GemmaModuleConfig(num_hidden_layers=3, layer_types=[
                                  "sliding_attention", "full_attention", "sliding_attention"], **mod), vocab_size=128)
    spec = ModelSpec.from_config(config)
    assert (spec.num_layers, spec.kv_shape(0), spec.sliding_window, spec.cross_attention) == (3, (2, 8, 8), 4, True)
    assert spec.layer_types == ("sliding_attention", "full_attention", "sliding_attention")


def test_side_state_layer_types_are_attention_layers():
    """Indexed layers attend over all tokens; DeepSeek-V4's compressed layers over a sliding window,
    with a compress rate per layer from ``compress_rates``; a compressed layer without one is refused."""
    from types import SimpleNamespace

    from tiercache.errors import PolicyError

    types = ["indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
    cfg = SimpleNamespace(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                          sliding_window=8, layer_types=types,
                          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    spec = ModelSpec.from_config(cfg)
    assert [spec.attends(i) for i in range(4)] == [True] * 4
    assert [spec.window(i) for i in range(4)] == [None, 8, 8, 8]
    assert [spec.compress_rate(i) for i in range(4)] == [None, 4, 128, None]
    assert [lp.compress_rate for lp in TieredCache.layer_policies(tiercache_policy(), spec)] == [None, 4, 128, None]
    cfg.compress_rates = {"compressed_sparse_attention": 4}
    with pytest.raises(PolicyError, match="compress_rates\\['heavily_compressed_attention'\\]"):
        ModelSpec.from_config(cfg)


def tiercache_policy():
    from tiercache import Policy

    return Policy()
