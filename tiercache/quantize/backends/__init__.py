"""Quantization backends by name, imported lazily (one module per backend).

Registry
    NAMES                       backend names a policy may give
    validate(config, where)     ``PolicyError`` when the backend cannot do what the policy asks
                                (bits, format) or its package is missing; imports no heavy package
                                (both from ``tiercache.policy.backends``, the table of what each
                                backend accepts, which the policy checks without this package)
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

Each backend module defines ``make(config) -> Backend``; what it supports (bits, formats, the
package it needs) is its row of ``tiercache.policy.backends.SUPPORT``.
"""

from __future__ import annotations

import importlib

from tiercache.policy.backends import NAMES, validate

__all__ = ["NAMES", "for_tensor", "get", "validate"]


def _module(name: str):
    return importlib.import_module(f"tiercache.quantize.backends.{name}")


def get(config):
    """The backend object for ``config`` (validated first, so errors name the backend)."""
    validate(config, "quantize")
    return _module(config.backend).make(config)


def for_tensor(backend, which: str):
    """``backend`` specialised for ``"keys"`` or ``"values"`` (an optional hook; default: itself)."""
    hook = getattr(backend, "for_tensor", None)
    return backend if hook is None else hook(which)
