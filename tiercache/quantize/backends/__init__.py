"""Quantization backends by name, imported lazily (one module per backend).

Registry
    NAMES                       backend names a policy may give
    validate(config, where)     ``PolicyError`` when the backend cannot do what the policy asks
                                (bits, format) or its package is missing; imports no heavy package
    get(config) -> Backend      the backend object for a ``QuantizePolicy``
    for_tensor(backend, which)  the backend for ``"keys"`` / ``"values"`` (a backend's optional
                                ``for_tensor`` hook, e.g. native's per-tensor ``clip``; else itself)

Backend interface (what ``tiercache.quantize.blocks`` uses)
    bits: int                   bits per stored code (8 for fp8)
    has_offset: bool            False for symmetric formats (fp8): no zero point is stored
    code_dtype: torch.dtype     torch.uint8 for integer codes, torch.float8_e4m3fn for fp8
    quantize(x, dim) -> (codes, scale, offset)
        ``x`` float, groups run along ``dim``; ``codes`` has ``x``'s shape (integers in
        ``[0, 2**bits)`` as uint8, or fp8), ``scale`` / ``offset`` keep ``dim`` as size 1, float32.
        Reconstruction is ``codes * scale + offset`` (``offset`` None: ``codes * scale``); every
        backend maps its own convention (zero point, shift) onto that one affine form, so one
        vectorized dequantization serves all.

Each backend module defines ``PACKAGE`` (None or the import name checked with ``find_spec``),
``check(config) -> str | None`` (what is unsupported, in words) and ``make(config) -> Backend``.
"""

from __future__ import annotations

import importlib
import importlib.util

from tiercache.errors import PolicyError

NAMES = ("native", "quanto", "hqq")


def _module(name: str):
    return importlib.import_module(f"tiercache.quantize.backends.{name}")


def _package_present(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def validate(config, where: str) -> None:
    if config.backend not in NAMES:
        raise PolicyError(f"{where}.backend: unknown backend {config.backend!r}; allowed: {', '.join(NAMES)}")
    if getattr(config, "clip", "minmax") != "minmax" and (config.backend != "native" or config.format != "int"):
        raise PolicyError(f"{where}.clip: {config.clip!r} is a native integer-format option (backend native, "
                          f"format int); got backend {config.backend!r}, format {config.format!r}; use clip: minmax")
    module = _module(config.backend)
    problem = module.check(config)
    if problem is not None:
        raise PolicyError(f"{where}: backend {config.backend!r} {problem}")
    if module.PACKAGE is not None and not _package_present(module.PACKAGE):
        raise PolicyError(
            f"{where}.backend: backend {config.backend!r} needs the package {module.PIP!r}, which is not "
            f"installed (pip install {module.PIP}); or use backend: native"
        )


def get(config):
    """The backend object for ``config`` (validated first, so errors name the backend)."""
    validate(config, "quantize")
    return _module(config.backend).make(config)


def for_tensor(backend, which: str):
    """``backend`` specialised for ``"keys"`` or ``"values"`` (an optional hook; default: itself)."""
    hook = getattr(backend, "for_tensor", None)
    return backend if hook is None else hook(which)
