"""ModelSpec: the few facts about a model that the cache and the planner need.

``ModelSpec.from_config(config)`` reads a transformers config (or any object with the same
attributes: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` ...); ``PRESETS`` holds
well-known model shapes so that planning works with no network. Reading a config needs no
transformers import (attributes only).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.errors import PolicyError

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    layer_types: tuple[str, ...]
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    dtype: str = "bfloat16"

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @classmethod
    def from_config(cls, config) -> "ModelSpec":
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        n = getattr(config, "num_hidden_layers", None)
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(n, int) or not isinstance(heads, int):
            raise PolicyError(
                f"model config {type(config).__name__} lacks num_hidden_layers / num_attention_heads: not a decoder config"
            )
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:
            chunk = getattr(config, "attention_chunk_size", None)
            kind = "sliding_attention" if window else ("chunked_attention" if chunk else "full_attention")
            window = window or chunk
            types = [kind] * n
        types = tuple(types)
        unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention", "chunked_attention")})
        if unknown:
            raise PolicyError(
                f"model layer types {unknown} are not supported by tiercache (attention layers only: "
                "full_attention, sliding_attention, chunked_attention)"
            )
        if any(t != "full_attention" for t in types) and not window:
            window = getattr(config, "attention_chunk_size", None)
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
        )


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
    )
}
