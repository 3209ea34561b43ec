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
