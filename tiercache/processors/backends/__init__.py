"""Quantization backends by name, imported lazily (see each module's docstring).

``validate(config, where)`` raises ``PolicyError`` when the backend cannot do what the policy asks
(bits, axis, group size, format) or its package is missing.
"""

from __future__ import annotations

from tiercache.errors import PolicyError

NAMES = ("native", "quanto", "hqq")


def validate(config, where: str) -> None:
    if config.backend not in NAMES:
        raise PolicyError(f"{where}.backend: unknown backend {config.backend!r}; allowed: {', '.join(NAMES)}")
