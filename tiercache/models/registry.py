"""The built-in model names: one registry that ``generate``, ``bench``, ``plan`` and ``validate`` share.

Interface
- ``NAMES``: the names, in the order help texts list them.
- ``describe() -> str``: ``'tiny' (...), 'tiny-random' (...), 'smollm2-135m' (...)`` for messages.
- ``config(name)``: the transformers config, without weights (nothing converted or trained).
- ``load(name, device, dtype) -> (model, tokenizer)``: the model in eval mode on ``device``.

``name`` must be in ``NAMES`` (a ``KeyError`` otherwise: callers check first). Loaders are
imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

BUILTIN = {
    "tiny": "the built-in trained byte-level Llama, 1.9M parameters",
    "tiny-random": "the same shape, randomly initialised",
    "smollm2-135m": "SmolLM2-135M-Instruct, a real chat model; needs the 'real' extra",
}
NAMES = tuple(BUILTIN)


def describe() -> str:
    return ", ".join(f"{name!r} ({what})" for name, what in BUILTIN.items())


def config(name: str):
    if name == "smollm2-135m":
        from tiercache.models import real

        return real.config()
    from tiercache.models.tiny import model_config

    return model_config(name)


def load(name: str, device: str = "cpu", dtype=None):
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if name == "smollm2-135m":
        from tiercache.models import real

        return real.load(device, dtype)
    from tiercache.models.tiny import ByteTokenizer, load_tiny, tiny_random

    if name not in ("tiny", "tiny-random"):
        raise KeyError(name)
    model = load_tiny() if name == "tiny" else tiny_random()
    return model.to(device=device, dtype=dtype), ByteTokenizer()
