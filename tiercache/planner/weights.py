"""Model weights: their shapes (``Arch``) and the bytes they take in a given format.

Interface
    Arch.from_config(config) -> Arch | None     hidden / MLP / vocab sizes of a decoder config
                                                (None when the config lacks them)
    arch_preset(name) -> Arch | None            the shapes of ``tiercache.models.spec.PRESETS``
    weight_bytes(arch, fmt) -> int              parameters (and norms) in format ``fmt``
    module_bytes(module) -> int                 a loaded model's parameters and buffers, exactly
    FORMATS                                     ``fp32 fp16 bf16 int8 int4``

Weight formats (``--weights``): ``fp32``, ``fp16``, ``bf16`` store every parameter in that
dtype. ``int8`` and ``int4`` are weight-only quantization of the decoder layers' linear weights
(bitsandbytes / quanto / HQQ style): ``int8`` one byte per weight plus one scale per output row,
``int4`` half a byte plus a 16-bit scale and zero point per group of 64 weights (4.5 bits).
The embeddings, the LM head and the norms stay in the model's dtype, as those libraries keep them.
Counting from a config is exact for Llama-like decoders (q/k/v/o projections, a gated MLP of
gate/up/down, RMSNorm, optional q/k/v biases, MoE experts, tied or untied LM head); other
layouts are close, and a loaded model (``module_bytes``) is always exact.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("fp32", "fp16", "bf16", "int8", "int4")
_DTYPE_OF = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}
_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}
INT4_GROUP = 64
_NOT_GATED = ("gpt_neox", "gpt2", "gptj", "phi", "falcon", "bloom", "opt", "gpt_bigcode", "starcoder2")


@dataclass(frozen=True)
class Arch:
    """The shapes that decide a decoder's weights and its prefill activations."""

    hidden: int
    intermediate: int
    vocab: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    layers: int
    dtype: str = "bfloat16"  # the model's dtype (activations are in it too)
    tied: bool = False  # LM head shares the embedding matrix
    gated: bool = True  # gate/up/down MLP (SwiGLU); else up/down
    experts: int = 1  # MoE experts per layer (all held in memory)
    active_experts: int = 1  # experts a token runs through (activations)
    qkv_bias: bool = False

    @property
    def dtype_bytes(self) -> int:
        return _BYTES[_DTYPE_OF.get(self.dtype, "fp32")]

    @property
    def native_format(self) -> str:
        return _DTYPE_OF.get(self.dtype, "fp32")

    @classmethod
    def from_config(cls, config) -> "Arch | None":
        """None when the config lacks the sizes, or holds them per layer (heterogeneous configs)."""
        try:
            return cls._read(config)
        except Exception:  # noqa: BLE001 - transformers refuses global reads of per-layer attributes
            return None

    @classmethod
    def _read(cls, config) -> "Arch | None":
        if getattr(config, "is_heterogeneous", False):
            return None
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
        hidden, vocab, heads, layers = get("hidden_size"), get("vocab_size"), get("num_attention_heads"), get(
            "num_hidden_layers")
        inter = get("intermediate_size") or get("ffn_dim") or get("n_inner") or (4 * hidden if hidden else None)
        if not all(isinstance(x, int) and x > 0 for x in (hidden, vocab, heads, layers, inter)):
            return None
        kv = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or hidden // heads
        dtype = str(get("dtype", None) or get("torch_dtype", None) or "float32").replace("torch.", "")
        experts = get("num_local_experts") or get("num_experts") or 1
        return cls(hidden, inter, vocab, heads, kv, head_dim, layers, dtype,
                   tied=bool(get("tie_word_embeddings", False)),
                   gated=get("model_type", "") not in _NOT_GATED, experts=int(experts),
                   active_experts=int(get("num_experts_per_tok") or 1),
                   qkv_bias=bool(get("attention_bias", False) or get("model_type", "") == "qwen2"))

    def linear_params(self) -> int:
        """Weights of the decoder layers' linear maps (what int8 / int4 quantize)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated else 2) * self.hidden * self.intermediate * self.experts
        router = self.hidden * self.experts if self.experts > 1 else 0
        return self.layers * (attn + mlp + router)

    def other_params(self) -> int:
        """Embeddings, LM head, norms and biases (kept in the model's dtype)."""
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = self.layers * 2 * self.hidden + self.hidden
        bias = self.layers * self.head_dim * (self.heads + 2 * self.kv_heads) if self.qkv_bias else 0
        return embed + norms + bias


def weight_bytes(arch: Arch, fmt: str | None = None) -> int:
    """Bytes of the model's weights in ``fmt`` (default: the model's dtype)."""
    fmt = fmt or arch.native_format
    if fmt not in FORMATS and fmt != "fp64":
        raise ValueError(f"weights format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    other = arch.other_params() * (arch.dtype_bytes if fmt in ("int8", "int4") else _BYTES[fmt])
    linear = arch.linear_params()
    if fmt == "int8":
        rows = arch.layers * (arch.head_dim * (2 * arch.heads + 2 * arch.kv_heads) + arch.hidden
                              + (2 if arch.gated else 1) * arch.intermediate * arch.experts + arch.hidden * arch.experts)
        return other + linear + rows * 2
    if fmt == "int4":
        return other + linear // 2 + -(-linear // INT4_GROUP) * 4  # 16-bit scale + zero per group
    return other + linear * _BYTES[fmt]


def module_bytes(module) -> int:
    """Parameters and buffers of a loaded ``torch.nn.Module``, each storage counted once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


_PRESET_ARCHS = {
    "llama-3-8b": Arch(4096, 14336, 128256, 32, 8, 128, 32),
    "llama-3-70b": Arch(8192, 28672, 128256, 64, 8, 128, 80),
    "mistral-7b": Arch(4096, 14336, 32000, 32, 8, 128, 32),
    "gemma-2-9b": Arch(3584, 14336, 256000, 16, 8, 256, 42, tied=True),
    "qwen2.5-7b": Arch(3584, 18944, 152064, 28, 4, 128, 28, qkv_bias=True),
}


def arch_preset(name: str) -> Arch | None:
    return _PRESET_ARCHS.get(str(name).lower())
