"""Tiny random-weight models built from configs (no hub), one per family the tests cover.

``FAMILIES`` maps a readable id to a builder; ``build(name)`` returns an eval-mode model in
float32 with a fixed seed. Mistral has every layer sliding (window 8); Gemma 2/3 alternate
sliding (window 8) and full layers, so short prompts already exercise the window.
"""

from __future__ import annotations

import torch
import transformers as tf

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
              bos_token_id=2)


def _config(name: str):
    if name == "llama":
        return tf.LlamaConfig(num_hidden_layers=3, **COMMON), tf.LlamaForCausalLM
    if name == "mistral":
        return tf.MistralConfig(num_hidden_layers=3, sliding_window=8, **COMMON), tf.MistralForCausalLM
    if name == "gemma2":
        return tf.Gemma2Config(num_hidden_layers=4, sliding_window=8, head_dim=16, **COMMON), tf.Gemma2ForCausalLM
    if name == "gemma3":
        cfg = tf.Gemma3TextConfig(num_hidden_layers=4, sliding_window=8, head_dim=16,
                                  layer_types=["sliding_attention", "full_attention"] * 2, **COMMON)
        return cfg, tf.Gemma3ForCausalLM
    if name == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=3, **COMMON), tf.Qwen2ForCausalLM
    if name == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=3, head_dim=16, **COMMON), tf.Qwen3ForCausalLM
    if name == "phi3":
        return tf.Phi3Config(num_hidden_layers=2, **COMMON), tf.Phi3ForCausalLM
    if name == "mixtral":
        return tf.MixtralConfig(num_hidden_layers=2, num_local_experts=2, sliding_window=8, **COMMON), tf.MixtralForCausalLM
    if name == "cohere2":
        return tf.Cohere2Config(num_hidden_layers=4, sliding_window=8, **COMMON), tf.Cohere2ForCausalLM
    if name == "gpt_neox":
        kw = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
        return tf.GPTNeoXConfig(num_hidden_layers=2, **kw), tf.GPTNeoXForCausalLM
    if name == "gemma3n":  # KV sharing: the last 2 layers reuse the K/V of the last sliding / full layer
        cfg = tf.Gemma3nTextConfig(
            num_hidden_layers=4, num_kv_shared_layers=2, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
            vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, altup_num_inputs=2, laurel_rank=4,
            **{**COMMON, "hidden_size": 32, "intermediate_size": 64})
        return cfg, tf.Gemma3nForCausalLM
    from hybrid_models import HYBRID, model_class, tiny_config

    if name in HYBRID:  # hybrid and recurrent families (state layers): tests/hybrid_models.py
        return tiny_config(name), model_class(name)
    raise KeyError(name)


# KV sharing (Gemma 3n): layers that read another layer's K/V and never write the cache.
KV_SHARING_FAMILIES = ["gemma3n"]

# Beyond the core families: other attention layouts (fused QKV, MoE, sliding + full, no GQA).
MORE_FAMILIES = ["phi3", "mixtral", "cohere2", "gpt_neox"]

FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "qwen2", "qwen3"]


def build(name: str, seed: int = 0):
    config, cls = _config(name)
    config._attn_implementation = "eager" if name.startswith("gemma") else "sdpa"
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def prompt(batch: int = 1, length: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


# Encoder-decoder models (cross-attention): the decoder differs from the encoder in layers and heads
# where the family allows it, so a cache sized from the wrong half fails.
SEQ2SEQ = ["bart", "t5", "whisper"]
_S2S = dict(vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2)


def _seq2seq_config(name: str, decoder_layers: int = 3):
    if name == "bart":
        return tf.BartConfig(d_model=32, encoder_layers=2, decoder_layers=decoder_layers, encoder_attention_heads=4,
                             decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                             max_position_embeddings=128, forced_eos_token_id=None, **_S2S), tf.BartForConditionalGeneration
    if name == "t5":  # transformers' own default cache needs num_layers == num_decoder_layers for T5
        return tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=decoder_layers, num_decoder_layers=decoder_layers,
                           num_heads=4, **_S2S), tf.T5ForConditionalGeneration
    if name == "whisper":
        return tf.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=decoder_layers, encoder_attention_heads=4,
                                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                                max_source_positions=16, max_target_positions=64, begin_suppress_tokens=None,
                                suppress_tokens=None, **_S2S), tf.WhisperForConditionalGeneration
    raise KeyError(name)


def build_seq2seq(name: str, seed: int = 0, decoder_layers: int = 3):
    config, cls = _seq2seq_config(name, decoder_layers)
    torch.manual_seed(seed)
    return cls(config).eval()


def seq2seq_inputs(name: str, batch: int = 2, length: int = 10, seed: int = 1) -> dict:
    """Encoder inputs: token ids, or for Whisper log-mel features ``[B, mel bins, 2 * max_source_positions]``."""
    g = torch.Generator().manual_seed(seed)
    if name == "whisper":
        return {"input_features": torch.randn(batch, 8, 32, generator=g)}
    return {"input_ids": torch.randint(3, 128, (batch, length), generator=g)}


def encoder_length(name: str, length: int = 10) -> int:
    """Tokens the encoder outputs for ``seq2seq_inputs`` (Whisper: its conv halves the 32 frames)."""
    return 16 if name == "whisper" else length
