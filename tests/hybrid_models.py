"""Tiny hybrid and recurrent models built from transformers' own config classes (no hub).

``HYBRID``: the causal-LM families of the installed transformers whose layers are not all
attention layers (``linear_attention`` / ``conv`` state layers, ``hybrid`` layers, ``mlp`` /
``moe`` layers), each built tiny. ``tiny_config(model_type)`` passes the config class small
values for every size field it has (``SMALL``, then the family's ``EXTRA``: a few layers, at
least one attention layer where the family has any); ``build(model_type)`` returns the
eval-mode model in float32, fixed seed.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

HYBRID = ["bamba", "bailing_hybrid", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear",
          "lara_mini", "lfm3", "mamba", "mamba2", "nemotron_h", "olmo_hybrid", "qwen3_5_text", "qwen3_5_moe_text",
          "qwen3_next", "recurrent_gemma", "zamba", "zamba2", "zaya", "inkling_text", "inkling2_text",
          "inkling2_loop_text"]

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2,
             moe_intermediate_size=32, shared_intermediate_size=32, shared_expert_intermediate_size=32,
             num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             linear_num_heads=4, linear_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, mamba_d_state=16, state_size=16, ssm_state_size=16,
             mamba_n_heads=8, mamba_d_head=16, n_mamba_heads=8, mamba_n_groups=1, n_groups=1, num_heads=8,
             mamba_headdim=16, mamba_d_ssm=128, adapter_rank=8, attention_head_dim=16, lru_width=64,
             sliding_window=8, attention_window_size=8, chunk_size=16, layer_group_size=2, first_k_dense_replace=1,
             num_mtp_layers=0, time_step_rank=8, num_key_value_heads_per_layer=None, unpadded_vocab_size=128,
             swa_head_dim=16, sliding_window_size=8, router_hidden_size=32)

EXTRA = {  # per family: the layers (a few, one of them attention where the family has any)
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1]),
    "falcon_h1": dict(num_hidden_layers=2),
    "falcon_mamba": dict(num_hidden_layers=2),
    "mamba": dict(num_hidden_layers=2),
    "mamba2": dict(num_hidden_layers=2),
    "granitemoehybrid": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "jamba": dict(num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "recurrent_gemma": dict(num_hidden_layers=3),
    "zamba": dict(num_hidden_layers=8),  # two hybrid layers (2, 7): they share weights
    "zamba2": dict(num_hidden_layers=7, layer_types=["linear_attention"] * 6 + ["hybrid"]),
    "zaya": dict(num_experts_per_tok=1),
}

ATTENTION = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")


def tiny_config(model_type: str, layers: int = 3):
    cls = CONFIG_MAPPING[model_type]
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    default = cls()
    kw = {k: v for k, v in SMALL.items() if k in fields and getattr(default, k, None) is not None}
    kw.update(EXTRA.get(model_type, {}))
    if "num_hidden_layers" not in kw and "layer_types" in fields:
        types = list(default.layer_types)
        first = next((i for i, t in enumerate(types) if t in ATTENTION), 0)  # keep the first attention layer
        n = max(layers, first + 1)
        kw.update(num_hidden_layers=n, layer_types=types[:n])
    return cls(**kw)


def model_class(model_type: str):
    return getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build(model_type: str, seed: int = 0):
    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    return model_class(model_type)(cfg).eval()
