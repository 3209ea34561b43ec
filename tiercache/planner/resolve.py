"""A model named on the command line or in a call -> its ``ModelSpec``.

Interface
    resolve_model(name_or_path) -> ModelSpec
        a preset (any case), a built-in model (``tiercache.models.registry.NAMES``), a local dir /
        config.json, or a hub id; ``PolicyError`` naming the presets otherwise
    local_config(name_or_path) -> config | None
        a built-in model's or a local config.json's config (what ``resolve_model`` and the whole
        footprint's shapes both read); None for a preset or a hub id
"""

from __future__ import annotations

import json
from pathlib import Path

from tiercache.errors import PolicyError
from tiercache.models.spec import PRESETS, ModelSpec


def resolve_model(model: str) -> ModelSpec:
    """A preset name (any case), a built-in model (``tiercache.models.registry.NAMES``), a local dir /
    config.json (read as JSON), or a hub id."""
    key = str(model).lower()
    if key in PRESETS:
        return PRESETS[key]
    config = local_config(model)
    if config is not None:
        from tiercache.models import registry as builtin

        spec = ModelSpec.from_config(config)
        if key in builtin.NAMES:
            from dataclasses import replace

            spec = replace(spec, name=key)
        return spec
    try:
        from transformers import AutoConfig

        return ModelSpec.from_config(AutoConfig.from_pretrained(model))
    except Exception as e:  # noqa: BLE001 - any hub / network failure becomes one clear message
        names = ", ".join(s.name for s in PRESETS.values())
        raise PolicyError(
            f"--model {model!r}: not a preset, a local config, or a reachable hub id ({type(e).__name__}: {e}); "
            f"presets: {names}"
        ) from e


def local_config(model: str):
    """The config of a built-in model (``tiercache.models.registry.NAMES``: no network, no weights
    needed) or of a local dir / config.json (read as JSON), else ``None`` (a preset or a hub id).
    ``PolicyError`` for a config file that is not a JSON object."""
    from tiercache.models import registry as builtin

    key = str(model).lower()
    if key in builtin.NAMES:
        return builtin.config(key)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PolicyError(f"model config {str(path)!r} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise PolicyError(f"model config {str(path)!r} must be a JSON object, got {type(data).__name__}")
    return _JsonConfig(data, str(path.parent))


class _JsonConfig:
    """Attribute view of a config.json (multimodal configs: the ``text_config`` part)."""

    def __init__(self, data: dict, name: str):
        data = data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data
        self.__dict__.update(data)
        self._name_or_path = name
        self.dtype = data.get("dtype") or data.get("torch_dtype") or "bfloat16"
