"""Tiny hybrid, recurrent, indexed and compressed models built from transformers' own config classes (no hub).

``HYBRID``: the causal-LM families of the installed transformers whose layers are not all
attention layers (``linear_attention`` / ``conv`` state layers, ``hybrid`` layers, ``mlp`` /
``moe`` layers), each built tiny. ``tiny_config(model_type)`` passes the config class small
values for every size field it has (``SMALL``, then the family's ``EXTRA``: a few layers, at
least one attention layer where the family has any); ``INDEXED``: the families with
``indexed_attention`` layers (sparse attention's indexer keys), ``COMPRESSED``: DeepSeek-V4 (compressed
attention layers); ``build(model_type)`` returns the
eval-mode model in float32, fixed seed.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# attention layers with a side state: indexer keys (Dynamic Sparse Attention) / DeepSeek-V4's compressor state
INDEXED = ["axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "hy_v4", "qwen4_exp_text"]
COMPRESSED = ["deepseek_v4"]

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
    # indexed attention: MLA heads (kv heads = heads), a small indexer whose top-k (4) is below the tokens held
    **{f: dict(num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=16, index_n_heads=2, index_head_dim=16,
               index_topk=4, layer_types=["indexed_attention"] * 2, mlp_layer_types=["dense", "sparse"])
       for f in ("axk2", "deepseek_v32", "glm_moe_dsa")},
    "hy_v4": dict(num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=16, index_n_heads=2, index_head_dim=16,
                  index_topk=4, layer_types=["indexed_attention"] * 2, mlp_layer_types=["dense", "sparse"],
                  indexer_types=["full", "shared"]),
    "dots3_note_text": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, index_n_heads=2,
                            index_head_dim=16, index_topk=4,
                            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
                            mlp_layer_types=["dense", "sparse", "sparse"], swa_num_attention_heads=4,
                            swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16, swa_head_dim=16,
                            swa_qk_nope_head_dim=8, swa_v_head_dim=16, shared_experts_intermediate_size=32),
    "qwen4_exp_text": dict(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], hc_lowrank=8,
                           ngram_vocab_size_base=256, split_ngram_parts=2, heads_per_ngram=2, indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2),
    # DeepSeek-V4: one layer of each kind, compress rates small enough to emit entries within a few tokens
    "deepseek_v4": dict(num_hidden_layers=3, num_key_value_heads=1,
                        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                        mlp_layer_types=["moe"] * 3, q_lora_rank=16, o_groups=2, o_lora_rank=8, index_n_heads=2,
                        index_head_dim=16, index_topk=2),
}

# other families' names for the same sizes (older configs; encoder-decoder decoders): the family sweep
# (bench/family_sweep.py) passes them too, so that every family it builds is tiny
GENERIC_SMALL = dict(d_model=64, n_embd=64, n_layer=2, n_head=4, n_positions=256, n_ctx=256, num_layers=2,
                     decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
                     decoder_ffn_dim=64, encoder_ffn_dim=64, d_ff=64, d_kv=16, ffn_dim=64, n_inner=64,
                     num_heads=4, embed_dim=64, word_embed_proj_dim=64, max_target_positions=256,
                     max_source_positions=256, type_vocab_size=2, embedding_size=64)

SWEEP_EXTRA = {  # families whose sizes have names or constraints of their own (the family sweep)
    **{f: dict(head_dim=16) for f in ("hunyuan_v1_dense", "ministral")},
    "nemotron": dict(head_dim=16, num_key_value_heads=2),
    "hunyuan_v1_moe": dict(head_dim=16, num_experts=4, moe_topk=2, moe_intermediate_size=32),
    **{f: dict(rotary_dim=8) for f in ("codegen", "gptj")},
    "deepseek_v2": dict(num_experts_per_tok=2, num_key_value_heads=4),
    "gemma4_text": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=128,
                         hidden_size_per_layer_input=8, laurel_rank=8, altup_num_inputs=2,
                         layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4),
    "cpmant": dict(dim_model=64, dim_head=16, dim_ff=64, num_layers=2, num_heads=4, vocab_size=128, prompt_length=4),
    "xlm": dict(emb_dim=64, n_layers=2, n_heads=4, vocab_size=128),
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]], window_size=8),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "lfm2_moe": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4,
                     num_experts_per_tok=2),
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=4,
                          zero_expert_num=1, moe_topk=2, num_key_value_heads=4, q_lora_rank=16),
}

ATTENTION = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding", "indexed_attention",
             "compressed_sparse_attention", "heavily_compressed_attention")


def tiny_config(model_type: str, layers: int = 3, generic: bool = False):
    """``model_type``'s config with small sizes; ``generic``: also the older names of ``GENERIC_SMALL``."""
    cls = CONFIG_MAPPING[model_type]
    if dataclasses.is_dataclass(cls):
        fields = {f.name for f in dataclasses.fields(cls)}
    else:  # an older config class: its __init__ keywords
        fields = set(inspect.signature(cls.__init__).parameters)
    default = cls()
    small = {**GENERIC_SMALL, **SMALL} if generic else SMALL
    kw = {k: v for k, v in small.items() if k in fields and _default(default, k) is not None}
    kw.update(EXTRA.get(model_type, {}))
    if generic:
        kw.update(SWEEP_EXTRA.get(model_type, {}))
    if "num_hidden_layers" not in kw and "layer_types" in fields:
        types = list(default.layer_types)
        first = next((i for i, t in enumerate(types) if t in ATTENTION), 0)  # keep the first attention layer
        n = max(layers, first + 1)
        kw.update(num_hidden_layers=n, layer_types=types[:n])
    return cls(**kw)


def _default(config, name: str):
    try:
        return getattr(config, name, None)
    except Exception:  # a per-layer attribute of a heterogeneous config (dots3): read per layer only
        return None


def model_class(model_type: str):
    return getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build(model_type: str, seed: int = 0, generic: bool = False, max_params: int | None = None):
    """The tiny model (eval mode, float32, ``seed``); ``max_params``: first counted on the meta device,
    ``ValueError`` when over (a config whose sizes did not take is not built at full size)."""
    cfg = tiny_config(model_type, generic=generic)
    if max_params is not None:
        with torch.device("meta"):
            n = sum(p.numel() for p in model_class(model_type)(cfg).parameters())
        if n > max_params:
            raise ValueError(f"{n} parameters with small sizes (over {max_params})")
    torch.manual_seed(seed)
    return model_class(model_type)(cfg).eval()


# -- driving a built model with a cache (the hybrid and indexed tests) ------------------------------------
NEW = 4  # tokens generate() adds


def ids(length: int = 6, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(m, cache):
    from tiercache.cache.compat import cache_arg

    return m.generate(ids(), **cache_arg(cache), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


def prefilled(m, policy, length: int = 6, batch: int = 1):
    """A fresh ``TieredCache`` of ``policy`` after a prompt of ``length`` tokens, and the next token."""
    from tiercache import TieredCache
    from tiercache.cache.compat import cache_arg

    cache = TieredCache.from_policy(policy, m.config)
    with torch.no_grad():
        logits = m(ids(length, batch=batch), **cache_arg(cache), use_cache=True).logits[:, -1:]
    return cache, logits.argmax(-1)


def decode(m, cache, nxt, steps: int = 3) -> list[torch.Tensor]:
    """The logits of ``steps`` greedy decode steps from ``nxt``."""
    from tiercache.cache.compat import cache_arg

    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = m(nxt, **cache_arg(cache), use_cache=True).logits[:, -1:]
            out.append(logits)
            nxt = logits.argmax(-1)
    return out


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
