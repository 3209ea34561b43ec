"""``load_model(name, device, dtype) -> (model, tokenizer)``: a built-in name
(``tiercache.models.registry``) or a local path / hub id (``AutoModelForCausalLM``);
``ModelLoadError`` (a ``ValueError``) saying what is accepted when it is none of these.
What the CLI, the server and the benchmarks load models through.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiercache.models import registry as builtin


class ModelLoadError(ValueError):
    """A model name that names nothing loadable here; the message says what is accepted."""


_ACCEPTED = ("'tiny' (the built-in trained model), 'tiny-random', 'smollm2-135m' (a real chat model, the "
             "'real' extra), a local model directory, or a hub id (needs network or a local hub cache)")


def load_model(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for ``"tiny"``, ``"tiny-random"`` or a local path / hub id.

    ``ModelLoadError`` when ``name`` is none of these: a planning preset (shape only, no
    weights), a path that does not exist, or a directory / hub id transformers cannot load.
    """
    if name in builtin.NAMES:
        try:
            return builtin.load(name, device, dtype)
        except ValueError as e:  # the real extra missing (real.MissingExtra)
            raise ModelLoadError(str(e)) from e
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tiercache.models.spec import PRESETS

        if not str(name).strip():
            raise ModelLoadError(f"model name is empty; use {_ACCEPTED}")
        if str(name).lower() in PRESETS and not Path(name).exists():
            raise ModelLoadError(f"model {name!r} is a preset shape for planning (tiercache plan / validate), "
                                 f"with no weights to run; use {_ACCEPTED}")
        if not Path(name).exists() and _path_like(str(name)):  # cannot be a hub id: say so at once
            raise ModelLoadError(f"model {name!r}: no such file or directory; use {_ACCEPTED}")
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
            tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:  # transformers' "not found / not reachable / not a model" errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"model {name!r} could not be loaded ({first}); use {_ACCEPTED}") from e
    return model.to(device=device, dtype=dtype), tok


def _path_like(name: str) -> bool:
    """A name that only a local path could be: a hub id is ``name`` or ``namespace/name``."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
