"""ModelSpec: the few facts about a model that the cache and the planner need.

``ModelSpec.from_config(config)`` reads a transformers config (or any object with the same
attributes: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` ...); ``PRESETS`` holds
well-known model shapes so that planning works with no network. Reading a config needs no
transformers import (attributes only).

What a layer caches, ``kv_shape(i) -> (kv_heads, key_dim, value_dim)``, follows what the
model passes to ``cache.update`` (transformers 5.x):
- most models: ``num_key_value_heads`` (else ``num_attention_heads``) heads of ``head_dim``
  (else ``hidden_size / num_attention_heads``), for keys and values alike;
- multi-query models that say so with ``multi_query`` (Falcon without the new decoder
  architecture, GPT-BigCode): one head;
- multi-head latent attention (a ``kv_lora_rank``: DeepSeek-V2/V3, MiniCPM3, GLM-4 MoE Lite ...):
  the compressed latents, one "head", keys ``kv_lora_rank`` wide and values
  ``qk_rope_head_dim`` wide;
- heterogeneous configs (``per_layer_config``, e.g. Gemma 4's wider full-attention layers):
  read layer by layer.
Windows follow transformers' ``DynamicCache(config=...)`` (``get_layer_types_and_kwargs``):
layer types come from ``layer_types``, else ``sliding_attention`` when ``sliding_window`` is set,
else ``chunked_attention`` when ``attention_chunk_size`` is; a sliding layer keeps
``sliding_window`` tokens and a chunked one ``attention_chunk_size`` (``window(i)``), even when a
config sets both. A chunked layer is a sliding layer for the cache (transformers uses the same
layer class: only the attention mask differs, and the model builds that).
Encoder-decoder configs (``is_encoder_decoder``: BART, T5, Whisper, Marian, Pegasus ...) are read
for their *decoder*, whose layers are what the cache holds: ``decoder_layers`` /
``num_decoder_layers``, ``decoder_attention_heads`` / ``num_heads``, ``d_kv`` (T5) else ``d_model /
heads`` (``decoder_view``), or a composite config's own ``decoder`` config (``EncoderDecoderConfig``:
BERT to GPT-2 ...); ``cross_attention`` is then True: each decoder layer also caches the
encoder output's K/V, of the same ``kv_shape(i)`` (``TieredCache.for_encoder_decoder``).
Hybrid and recurrent models: besides attention layers a config may name layers that
keep a fixed-size state instead of K/V (``linear_attention``: Mamba, gated delta nets ...;
``conv``: LFM), layers with both (``hybrid`` / ``hybrid_sliding``: Falcon-H1, Zamba) and layers
with neither (``mlp`` / ``moe``: Nemotron-H), as transformers' ``DynamicCache`` reads them:
``attends(i)`` (the layer caches K/V), ``states(i)`` (how many conv / recurrent state pairs it
keeps: ``number_of_conv_states``, else 1; 0 for attention-only layers). A model with no
attention layer at all (Mamba) needs no attention heads in its config.
Attention layers with a side state (``tiercache.cache.side_state``): ``indexed_attention``
(Dynamic Sparse Attention: DeepSeek-V3.2, GLM-MoE-DSA ...: full K/V plus indexer keys) and
DeepSeek-V4's ``compressed_sparse_attention`` / ``heavily_compressed_attention`` (a sliding
window of ``sliding_window`` plus a compressor state, ``compress_rate(i)`` tokens per compressed
entry from the config's ``compress_rates``). They attend (``attends(i)``): their K/V is tiered.
KV sharing (``kv_sharing_modes``, Gemma 3n / Gemma 4): a ``"reuse"`` layer never updates the
cache (it reads another layer's K/V), so it holds nothing; a ``"store"`` layer's returned K/V
are kept by the model and read after other layers have updated, so its chain must return
tensors of its own (``kv_sharing(i)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from tiercache.errors import PolicyError

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # K/V only
INDEXED_TYPES = ("indexed_attention",)  # K/V (full) and the indexer keys of sparse attention (DSA)
COMPRESSED_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")  # K/V (sliding) and a compressor state
HYBRID_TYPES = ("hybrid", "hybrid_sliding")  # K/V (full / sliding) and a conv / recurrent state
STATE_TYPES = ("linear_attention", "conv")  # a conv / recurrent state only
EMPTY_TYPES = ("mlp", "moe", "dummy")  # nothing cached (transformers' DummyLayer)
SIDE_STATE_TYPES = INDEXED_TYPES + COMPRESSED_TYPES  # attention layers with a side state (tiercache.cache.side_state)
KV_TYPES = ATTENTION_TYPES + SIDE_STATE_TYPES + HYBRID_TYPES  # the layers that cache K/V
LAYER_TYPES = ATTENTION_TYPES + SIDE_STATE_TYPES + HYBRID_TYPES + STATE_TYPES + EMPTY_TYPES


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    layer_types: tuple[str, ...]
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    dtype: str = "bfloat16"
    value_dim: int | None = None  # when values are not head_dim wide (None: head_dim)
    layer_shapes: tuple[tuple[int, int, int], ...] | None = None  # per layer when layers differ
    kv_sharing_modes: tuple[str | None, ...] | None = None  # per layer: None | "store" | "reuse"
    chunk_size: int | None = None  # window of chunked_attention layers (None: sliding_window)
    cross_attention: bool = False  # encoder-decoder: each layer also caches cross-attention K/V of kv_shape(i)
    state_counts: tuple[int, ...] | None = None  # per layer: conv / recurrent states kept (None: none anywhere)
    compress_rates: tuple[int | None, ...] | None = None  # per layer: DeepSeek-V4's compress rate (compressed layers)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def kv_shape(self, index: int) -> tuple[int, int, int]:
        """``(kv_heads, key_dim, value_dim)`` that layer ``index`` caches per token."""
        if self.layer_shapes is not None:
            return self.layer_shapes[index]
        return self.kv_heads, self.head_dim, self.value_dim or self.head_dim

    def window(self, index: int) -> int | None:
        """Tokens layer ``index`` keeps: None (full attention), ``sliding_window`` (sliding) or
        ``chunk_size`` (chunked; ``sliding_window`` when the spec has no chunk size)."""
        kind = self.layer_types[index]
        if kind in ("full_attention", "hybrid") + INDEXED_TYPES or not self.attends(index):
            return None
        if kind == "chunked_attention" and self.chunk_size is not None:
            return self.chunk_size
        return self.sliding_window

    def attends(self, index: int) -> bool:
        """Layer ``index`` caches attention K/V (attention layers, with a side state or not, and hybrid layers)."""
        return self.layer_types[index] in KV_TYPES

    def compress_rate(self, index: int) -> int | None:
        """DeepSeek-V4: tokens per compressed entry of a compressed layer (None for other layers)."""
        return None if self.compress_rates is None else self.compress_rates[index]

    def states(self, index: int) -> int:
        """How many conv / recurrent state pairs layer ``index`` keeps (0: none)."""
        return 0 if self.state_counts is None else self.state_counts[index]

    def kv_sharing(self, index: int) -> str | None:
        """``None``, ``"store"`` (later layers read its K/V) or ``"reuse"`` (it caches nothing)."""
        return None if self.kv_sharing_modes is None else self.kv_sharing_modes[index]

    def describe(self) -> str:
        """``2 kv heads x 64`` (or each distinct shape, when layers differ)."""
        shapes = sorted({self.kv_shape(i) for i in range(self.num_layers) if self.attends(i)}, reverse=True)
        if not shapes:
            return "no attention layers"
        return ", ".join(f"{h} kv heads x {k}" if k == v else f"{h} kv heads x {k} (keys) / {v} (values)"
                         for h, k, v in shapes)

    @classmethod
    def from_config(cls, config) -> "ModelSpec":
        cross = getattr(config, "is_encoder_decoder", False) is True
        sub = getattr(config, "decoder", None) if cross else None
        if isinstance(sub, dict):
            sub = SimpleNamespace(**sub)
        if sub is not None and hasattr(sub, "num_attention_heads"):  # a composite config (EncoderDecoderConfig):
            return replace(cls.from_config(sub), cross_attention=True)  # its decoder's own config, read as usual
        if cross:  # read before get_text_config, which gives BART a fresh default config
            config = decoder_view(config)
        elif hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        per_layer = list(config.per_layer_config) if getattr(config, "is_heterogeneous", False) else None
        name = getattr(config, "config_name", None) or type(config).__name__
        n = getattr(config, "num_hidden_layers", None)
        heads = _read(config, "num_attention_heads", per_layer)
        window = _read(config, "sliding_window", per_layer)
        chunk = _read(config, "attention_chunk_size", per_layer)
        types = getattr(config, "layer_types", None)
        if n is not None and types is None:
            kind = "sliding_attention" if window else ("chunked_attention" if chunk else "full_attention")
            types = [kind] * n
        attention = types is not None and any(t in KV_TYPES for t in types)
        if n is None or (heads is None and attention):
            raise PolicyError(f"model config {name} lacks num_hidden_layers / num_attention_heads: not a decoder config")
        _positive(n, "num_hidden_layers", name)
        types = tuple(types)
        if len(types) != n:
            raise PolicyError(f"model config {name}: layer_types has {len(types)} entries for num_hidden_layers={n}")
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            raise PolicyError(
                f"model layer types {unknown} are not supported by tiercache (supported: {', '.join(LAYER_TYPES)})"
            )
        if not attention:  # no K/V anywhere (Mamba): no attention shape to read
            shapes = [(1, 1, 1)] * n
        else:
            shapes = [_kv_shape(c, name) for c in per_layer] if per_layer else [_kv_shape(config, name)] * n
        kv_heads, head_dim, value_dim = shapes[0]
        counts = _state_counts(config, per_layer, types)
        if any(t in ("sliding_attention", "hybrid_sliding") + COMPRESSED_TYPES for t in types):
            window = window or chunk  # a sliding layer without sliding_window: the chunk size, as before
            _positive(window, "sliding_window (its sliding layers need a window)", name)
        if "chunked_attention" in types:
            chunk = chunk or window
            _positive(chunk, "attention_chunk_size (its chunked layers need a chunk size)", name)
            window = window or chunk
        try:
            sharing = getattr(config, "kv_sharing_modes", None)
        except ValueError as e:  # transformers validates the sharing layout when asked
            raise PolicyError(f"model config {type(config).__name__}: {e}") from e
        sharing = tuple(sharing) if sharing is not None and any(m is not None for m in sharing) else None
        dtype = getattr(config, "dtype", None) or "float32"
        dtype = str(dtype).replace("torch.", "")
        return cls(
            name=getattr(config, "_name_or_path", "") or getattr(config, "model_type", "model"),
            num_layers=n,
            layer_types=types,
            kv_heads=kv_heads,
            head_dim=head_dim,
            sliding_window=window,
            dtype=dtype if dtype in _DTYPE_BYTES else "float32",
            value_dim=value_dim if value_dim != head_dim else None,
            layer_shapes=tuple(shapes) if len(set(shapes)) > 1 else None,
            kv_sharing_modes=sharing,
            chunk_size=chunk if "chunked_attention" in types else None,
            cross_attention=cross,
            state_counts=counts,
            compress_rates=_compress_rates(config, types),
        )


_FIRST = {  # decoder attribute -> names encoder-decoder configs use for it, first found wins
    "num_hidden_layers": ("decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers"),
    "num_attention_heads": ("decoder_attention_heads", "num_decoder_attention_heads", "num_heads",
                            "num_attention_heads"),
    "head_dim": ("d_kv", "head_dim"),
    "hidden_size": ("d_model", "hidden_size"),
}


def decoder_view(config) -> SimpleNamespace:
    """The decoder of an encoder-decoder config, under decoder-only names (no GQA: keys and values
    have one head per attention head; transformers' attribute maps point ``num_hidden_layers`` and
    ``num_key_value_heads`` at the *encoder* of BART / Whisper, so raw names are read first)."""
    raw = getattr(config, "__dict__", {})

    def first(names):
        for n in names:
            value = raw.get(n) if n in raw else getattr(config, n, None)
            if value is not None:
                return value
        return None

    view = {k: first(names) for k, names in _FIRST.items()}
    view["num_key_value_heads"] = view["num_attention_heads"]
    for name in ("dtype", "_name_or_path", "model_type"):
        view[name] = getattr(config, name, None)
    view["config_name"] = f"{type(config).__name__} (decoder)"
    return SimpleNamespace(**view)


def _kv_shape(c, name: str) -> tuple[int, int, int]:
    """``(kv_heads, key_dim, value_dim)`` a decoder layer with config ``c`` passes to the cache."""
    heads = _positive(c.num_attention_heads, "num_attention_heads", name)
    rank, rope = getattr(c, "kv_lora_rank", None), getattr(c, "qk_rope_head_dim", None)
    if isinstance(rank, int) and isinstance(rope, int):  # MLA: the compressed latents, one "head"
        return 1, _positive(rank, "kv_lora_rank", name), _positive(rope, "qk_rope_head_dim", name)
    head_dim = getattr(c, "head_dim", None)
    if head_dim is None:
        hidden = getattr(c, "hidden_size", None)
        if hidden is None:
            raise PolicyError(f"model config {name} has neither head_dim nor hidden_size: cannot tell the head size")
        head_dim = _positive(hidden, "hidden_size", name) // heads
    head_dim = _positive(head_dim, "head_dim", name)
    if getattr(c, "multi_query", False) and not getattr(c, "new_decoder_architecture", False):
        return 1, head_dim, head_dim
    kv = getattr(c, "num_key_value_heads", None)
    return (heads if kv is None else _positive(kv, "num_key_value_heads", name)), head_dim, head_dim


def _state_counts(config, per_layer, types) -> tuple[int, ...] | None:
    """Conv / recurrent state pairs per layer (transformers: ``number_of_conv_states``, default 1)."""
    if not any(t in STATE_TYPES + HYBRID_TYPES for t in types):
        return None
    configs = per_layer or [config] * len(types)
    return tuple((getattr(c, "number_of_conv_states", None) or 1) if t in STATE_TYPES + HYBRID_TYPES else 0
                 for c, t in zip(configs, types))


def _compress_rates(config, types) -> tuple[int | None, ...] | None:
    """DeepSeek-V4's ``compress_rates`` (a dict: layer type -> tokens per compressed entry), per layer."""
    if not any(t in COMPRESSED_TYPES for t in types):
        return None
    rates = getattr(config, "compress_rates", None) or {}
    name = type(config).__name__
    return tuple(_positive(rates.get(t), f"compress_rates[{t!r}]", name) if t in COMPRESSED_TYPES else None
                 for t in types)


def _positive(value, field: str, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PolicyError(f"model config {name}: {field} must be a positive integer, got {value!r}")
    return value


def _read(config, name: str, per_layer):
    """A config attribute that heterogeneous configs may hold per layer: the first layer's that has it."""
    if per_layer:
        return next((v for v in (getattr(c, name, None) for c in per_layer) if v), None)
    return getattr(config, name, None)


def _alternating(n: int, every: int = 2) -> tuple[str, ...]:
    return tuple("sliding_attention" if i % every == 0 else "full_attention" for i in range(n))


PRESETS: dict[str, ModelSpec] = {
    s.name.lower(): s
    for s in (
        ModelSpec("Llama-3-8B", 32, ("full_attention",) * 32, kv_heads=8, head_dim=128),
        ModelSpec("Llama-3-70B", 80, ("full_attention",) * 80, kv_heads=8, head_dim=128),
        ModelSpec("Mistral-7B", 32, ("sliding_attention",) * 32, kv_heads=8, head_dim=128, sliding_window=4096),
        ModelSpec("Gemma-2-9B", 42, _alternating(42), kv_heads=8, head_dim=256, sliding_window=4096),
        ModelSpec("Qwen2.5-7B", 28, ("full_attention",) * 28, kv_heads=4, head_dim=128),
        # encoder-decoder (decoder layers; cross-attention K/V of the same shape): plan with --encoder-length
        ModelSpec("Whisper-large-v3", 32, ("full_attention",) * 32, kv_heads=20, head_dim=64, dtype="float16",
                  cross_attention=True),
        ModelSpec("BART-large", 12, ("full_attention",) * 12, kv_heads=16, head_dim=64, dtype="float32",
                  cross_attention=True),
    )
}


def spec_of(model_config) -> ModelSpec:
    """A transformers config read as a ``ModelSpec`` (a ModelSpec as it is)."""
    return model_config if isinstance(model_config, ModelSpec) else ModelSpec.from_config(model_config)


def model_type_of(model_config) -> str | None:
    """The ``model_type`` of a transformers config (its text config), None for a ModelSpec."""
    if isinstance(model_config, ModelSpec):
        return None
    if hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config(decoder=True)
    return getattr(model_config, "model_type", None) or None
