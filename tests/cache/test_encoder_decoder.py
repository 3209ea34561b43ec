"""Encoder-decoder models: ``TieredCache.for_encoder_decoder(policy, config)`` in ``generate`` and loops.

The reference is transformers' default for these models, an ``EncoderDecoderCache`` of two
``DynamicCache``s: at full precision (resident or offloaded) tokens, logits and the cached K/V of
both halves are identical; quantized cross-attention stays within a tolerance. Tiny random BART,
T5 and Whisper models (decoder layers and heads differ from the encoder's where the family allows).
"""

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache

from builders import SEQ2SEQ, build, build_seq2seq, encoder_length, seq2seq_inputs
from tiercache import CacheError, PolicyError, TieredCache
from tiercache.models.spec import ModelSpec
from tiercache.cache.compat import cache_arg

MODES = {
    "greedy": dict(),
    "beam": dict(num_beams=3, num_return_sequences=2),
    "sampled": dict(do_sample=True, top_k=20),
}
Q8 = {"bits": 8, "group_size": 8, "residual_length": 0}
LOSSLESS = {
    "fp": {},
    "cross-host": {"cross_attention": {"offload": {"device": "cpu", "prefetch": 1}}},
    "cross-disk": {"cross_attention": {"offload": {"device": "disk"}}},
    "all-host": {"offload": {"device": "cpu"}, "cross_attention": {"offload": {"device": "cpu"}}},
    "static-self": {"storage": "static", "max_length": 32},
}
# (policy, bound on the relative error of teacher-forced logits)
LOSSY = {
    "cross-int8": ({"cross_attention": {"quantize": Q8}}, 0.005),
    "cross-int4-host": ({"cross_attention": {"quantize": {**Q8, "bits": 4}, "offload": {"device": "cpu"}}}, 0.05),
    "self-int4-cross-fp": ({"quantize": {**Q8, "bits": 4, "residual_length": 8}}, 0.05),
}


def reference():
    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def gen(model, cache, inputs, **kw):
    torch.manual_seed(0)
    return model.generate(**inputs, **cache_arg(cache), max_new_tokens=10, min_new_tokens=10, **kw)


def legacy(half) -> list:
    return [(layer.keys, layer.values) for layer in half.layers]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_generate_matches_transformers_default(name, mode):
    model, inputs = build_seq2seq(name), seq2seq_inputs(name)
    torch.manual_seed(0)
    default = model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, **MODES[mode])  # its own cache
    ref, ours = reference(), TieredCache.for_encoder_decoder({}, model.config)
    assert isinstance(ours, EncoderDecoderCache)
    out = gen(model, ours, inputs, **MODES[mode])
    assert torch.equal(out, default) and torch.equal(out, gen(model, ref, inputs, **MODES[mode]))
    # both halves hold what DynamicCache holds, bit for bit, with the decoder's layer count
    for half, ref_half in ((ours.self_attention_cache, ref.self_attention_cache),
                           (ours.cross_attention_cache, ref.cross_attention_cache)):
        assert len(half.layers) == len(ref_half.layers) == 3
        for (k, v), (rk, rv) in zip(half.to_legacy(), legacy(ref_half)):
            assert torch.equal(k, rk) and torch.equal(v, rv)
    assert ours.cross_attention_cache.get_seq_length() == encoder_length(name)


@pytest.mark.parametrize("policy", list(LOSSLESS))
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_offloaded_and_static_halves_are_exact(name, policy):
    model, inputs = build_seq2seq(name), seq2seq_inputs(name)
    cache = TieredCache.for_encoder_decoder(LOSSLESS[policy], model.config)
    for mode in ("greedy", "beam"):
        cache.reset()
        assert torch.equal(gen(model, cache, inputs, **MODES[mode]), gen(model, reference(), inputs, **MODES[mode]))
    cache.close()


def teacher_forced(model, cache, inputs, steps: int = 8) -> torch.Tensor:
    """Logits of ``steps`` one-token decoder steps over a fixed token sequence: [B, steps, V]."""
    with torch.no_grad():
        enc = model.get_encoder()(**inputs)
        batch = enc.last_hidden_state.shape[0]
        tokens = torch.randint(3, 128, (batch, steps), generator=torch.Generator().manual_seed(9))
        tokens[:, 0] = model.config.decoder_start_token_id
        out = [model(encoder_outputs=enc, decoder_input_ids=tokens[:, i : i + 1], **cache_arg(cache)).logits
               for i in range(steps)]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_manual_loop_logits_are_identical_at_full_precision(name):
    model, inputs = build_seq2seq(name), seq2seq_inputs(name)
    ours = TieredCache.for_encoder_decoder({}, model.config)
    assert torch.equal(teacher_forced(model, ours, inputs), teacher_forced(model, reference(), inputs))


@pytest.mark.parametrize("policy", list(LOSSY))
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_quantized_policies_run_within_tolerance(name, policy):
    section, bound = LOSSY[policy]
    model, inputs = build_seq2seq(name), seq2seq_inputs(name)
    ours = TieredCache.for_encoder_decoder(section, model.config)
    got, want = teacher_forced(model, ours, inputs, 12), teacher_forced(model, reference(), inputs, 12)
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < bound, f"relative logits error {err:.4f}"
    ours.close()
    beams = gen(model, TieredCache.for_encoder_decoder(section, model.config), inputs, **MODES["beam"])
    assert beams.shape[0] == 4  # batch 2 x 2 returned sequences


def test_cross_attention_bytes_follow_its_section():
    model, inputs = build_seq2seq("bart"), seq2seq_inputs("bart", batch=2, length=64)
    fp = TieredCache.for_encoder_decoder({}, model.config)
    q = TieredCache.for_encoder_decoder({"cross_attention": {"quantize": {**Q8, "bits": 4}}}, model.config)
    gen(model, fp, inputs), gen(model, q, inputs)
    fp_cross, q_cross = sum(fp.cross_nbytes().values()), sum(q.cross_nbytes().values())
    # 3 layers, batch 2, 2 heads x 16, 64 encoder tokens, K and V, fp32 (full storage rounds up to 256 tokens)
    assert fp_cross == 3 * 2 * 2 * 256 * 16 * 2 * 4
    assert q_cross < fp_cross / 2
    assert fp.nbytes() == {"cpu": sum(fp.self_attention_cache.nbytes().values()) + fp_cross}
    assert fp.self_attention_cache.nbytes() == q.self_attention_cache.nbytes()  # the policy's part is alike


@pytest.mark.parametrize("name", ["bart", "whisper"])
def test_batch_operations_transformers_keeps_for_dynamic_caches(name):
    """crop / batch_select_indices / batch_repeat_interleave work on the tiered halves too."""
    model, inputs = build_seq2seq(name), seq2seq_inputs(name, batch=3)
    ref, ours = reference(), TieredCache.for_encoder_decoder({}, model.config)
    teacher_forced(model, ref, inputs, 6), teacher_forced(model, ours, inputs, 6)
    for op, arg in (("crop", -2), ("batch_select_indices", torch.tensor([2, 0])), ("batch_repeat_interleave", 2)):
        getattr(ref, op)(arg), getattr(ours, op)(arg)
        for half, ref_half in ((ours.self_attention_cache, ref.self_attention_cache),
                               (ours.cross_attention_cache, ref.cross_attention_cache)):
            assert all(torch.equal(k, rk) and torch.equal(v, rv)
                       for (k, v), (rk, rv) in zip(half.to_legacy(), legacy(ref_half))), op
    assert ours.get_seq_length() == 4 and ours.self_attention_cache.batch_size == 4


def test_batch_operations_refuse_halves_neither_tiered_nor_dynamic():
    from transformers import StaticCache

    from tiercache import TieredEncoderDecoderCache

    model = build_seq2seq("bart")
    ours = TieredCache.for_encoder_decoder({}, model.config)
    static = StaticCache(config=model.config, max_cache_len=8)
    with pytest.raises(CacheError, match="crop: needs TieredCache or DynamicCache halves, got StaticCache"):
        TieredEncoderDecoderCache(ours.self_attention_cache, static).crop(-1)
    TieredEncoderDecoderCache(ours.self_attention_cache, DynamicCache()).crop(0)  # a DynamicCache half is fine

def test_assisted_generation_matches():
    model, assistant = build_seq2seq("bart"), build_seq2seq("bart", seed=3)
    inputs = seq2seq_inputs("bart", batch=1)
    kw = dict(assistant_model=assistant)
    assert torch.equal(gen(model, TieredCache.for_encoder_decoder({}, model.config), inputs, **kw),
                       gen(model, reference(), inputs, **kw))


def test_decoder_layers_and_heads_come_from_the_decoder():
    """BART / Whisper map num_hidden_layers and heads to the encoder; the cache follows the decoder."""
    for name in ("bart", "whisper"):
        config = build_seq2seq(name, decoder_layers=5).config
        cache = TieredCache.for_encoder_decoder({}, config)
        assert len(cache.self_attention_cache.layers) == len(cache.cross_attention_cache.layers) == 5
        assert cache.self_attention_cache.model.kv_shape(0) == (2, 16, 16)
        assert ModelSpec.from_config(config).num_layers == 5


def test_from_policy_on_an_encoder_decoder_config_points_to_for_encoder_decoder():
    """A lone TieredCache would take the encoder's K/V into the self-attention layers."""
    with pytest.raises(PolicyError, match=r"encoder-decoder model: .* TieredCache.for_encoder_decoder"):
        TieredCache.from_policy({}, build_seq2seq("whisper").config)


def test_t5_with_more_decoder_layers_than_encoder_layers():
    """transformers' default cache is sized from the encoder here; ours from num_decoder_layers."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = build_seq2seq("t5").config.to_dict()
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(**{**config, "num_layers": 2, "num_decoder_layers": 4})).eval()
    inputs = seq2seq_inputs("t5")
    cache = TieredCache.for_encoder_decoder({}, model.config)
    assert len(cache.self_attention_cache.layers) == 4
    assert torch.equal(gen(model, cache, inputs), gen(model, reference(), inputs))


def test_a_decoder_only_model_is_refused():
    with pytest.raises(PolicyError, match="decoder-only"):
        TieredCache.for_encoder_decoder({}, build("llama").config)


def test_bad_cross_attention_sections_name_the_field():
    config = build_seq2seq("bart").config
    for section, message in (({"quantize": {"bits": 3}}, "policy.cross_attention.quantize"),
                             ({"offload": {"device": "gpu"}}, "policy.cross_attention.offload.device"),
                             ({"storage": "static"}, "policy.cross_attention.storage: unknown field")):
        with pytest.raises(PolicyError, match=message.replace(".", r"\.")):
            TieredCache.for_encoder_decoder({"cross_attention": section}, config)


def test_cross_layers_expose_keys_and_values_only_when_filled():
    config = build_seq2seq("bart").config
    cache = TieredCache.for_encoder_decoder({"cross_attention": {"quantize": Q8}}, config)
    layer = cache.cross_attention_cache.layers[0]
    assert layer.keys is None and layer.values is None and cache.is_updated == {0: False, 1: False, 2: False}
    k = torch.randn(1, 2, 9, 16)
    cache.cross_attention_cache.update(k, k * 2, 0)
    assert layer.keys.shape == (1, 2, 9, 16) and (layer.values - 2 * k).abs().max() < 0.05
    with pytest.raises(CacheError, match="layer 0"):
        cache.cross_attention_cache.update(k[:, :1], k[:, :1], 0)  # other heads than it holds: refused, named
    assert layer.keys.shape == (1, 2, 9, 16)


@pytest.mark.parametrize("policy", ["fp", "cross-int4-host"])
def test_deepcopy_forks_both_halves(policy):
    """``copy.deepcopy`` (transformers' prefix-reuse recipe) gives an independent encoder-decoder cache."""
    import copy

    section = LOSSLESS.get(policy, LOSSY.get(policy, (None,))[0])
    model, inputs = build_seq2seq("bart"), seq2seq_inputs("bart")
    cache = TieredCache.for_encoder_decoder(section, model.config)
    teacher_forced(model, cache, inputs, 4)
    twin = copy.deepcopy(cache)
    assert type(twin) is type(cache) and twin.is_updated == cache.is_updated
    assert all(torch.equal(a, b) for x, y in zip(twin.to_legacy(), cache.to_legacy()) for a, b in zip(x, y))
    twin.crop(-2)  # writing to one never shows in the other
    assert (twin.get_seq_length(), cache.get_seq_length()) == (2, 4)
    with torch.no_grad():
        enc = model.get_encoder()(**inputs)
        nxt, fork = torch.full((2, 1), 5), copy.deepcopy(cache)
        a = model(encoder_outputs=enc, decoder_input_ids=nxt, **cache_arg(cache)).logits
        b = model(encoder_outputs=enc, decoder_input_ids=nxt, **cache_arg(fork)).logits
    assert torch.equal(a, b)


def test_a_composite_encoder_decoder_config_uses_its_decoder_config():
    """EncoderDecoderModel (BERT encoder, GPT-2 decoder with cross-attention): read from config.decoder."""
    import transformers as tf

    enc = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    dec = tf.GPT2Config(vocab_size=128, n_embd=48, n_layer=3, n_head=4, add_cross_attention=True, is_decoder=True,
                        bos_token_id=2, eos_token_id=1)
    config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 2, 0, 1
    torch.manual_seed(0)
    model = tf.EncoderDecoderModel(config=config).eval()
    inputs = seq2seq_inputs("bart")
    cache = TieredCache.for_encoder_decoder({"cross_attention": {"offload": {"device": "cpu"}}}, model.config)
    assert len(cache.self_attention_cache.layers) == 3 and cache.self_attention_cache.model.kv_shape(0) == (4, 12, 12)
    assert torch.equal(gen(model, cache, inputs), gen(model, reference(), inputs))


def test_t5gemma_is_refused_with_the_reason():
    import transformers as tf

    config = tf.T5GemmaConfig(encoder=tf.T5GemmaModuleConfig(num_hidden_layers=1), vocab_size=128)
    with pytest.raises(PolicyError, match="t5gemma is not supported .* replaces the cross-attention cache"):
        TieredCache.for_encoder_decoder({}, config)
