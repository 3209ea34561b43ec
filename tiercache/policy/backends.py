"""What each quantization backend accepts, by name: the check of a policy's ``quantize`` section.

The backends themselves live in ``tiercache.quantize.backends`` and quantize tensors; this table
says which names, bit widths and formats a policy may ask of them and which package each needs,
so that a policy is checked without importing the quantize package (imports flow from
``quantize`` down to ``policy``) and without importing any backend's package.

    NAMES                       backend names a policy may give
    SUPPORT[name]               ``Support``: integer bit widths, whether ``format: fp8`` exists, the
                                package (checked with ``find_spec``) and its pip name
    validate(config, where)     ``PolicyError`` naming ``where`` when the backend cannot do what the
                                policy asks (bits, format, clip) or its package is missing
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from tiercache.errors import PolicyError


@dataclass(frozen=True)
class Support:
    bits: tuple[int, ...]  # integer formats
    fp8: bool = False  # format fp8 (8 bits, e4m3)
    package: str | None = None  # import name, None: pure torch
    pip: str | None = None


SUPPORT = {
    "native": Support(bits=(2, 4, 8), fp8=True),
    "quanto": Support(bits=(2, 4), package="optimum.quanto", pip="optimum-quanto"),
    "hqq": Support(bits=(1, 2, 3, 4, 8), package="hqq", pip="hqq"),
}
NAMES = tuple(SUPPORT)


def _package_present(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def _problem(config, s: Support) -> str | None:
    """What the backend ``s`` cannot do of ``config`` (bits, format), in words; None: supported."""
    bits = ", ".join(map(str, s.bits))
    if config.format == "fp8":
        if not s.fp8:
            return "supports only format 'int' (fp8 is native only); got format 'fp8'"
        return None if config.bits == 8 else f"format 'fp8' is 8 bits (e4m3); set bits: 8, got bits {config.bits}"
    if config.format != "int":
        return f"supports only format 'int' (fp8 is native only); got format {config.format!r}"
    if config.bits not in s.bits:
        fp8 = " (format 'int') and bits 8 with format 'fp8'" if s.fp8 else ""
        return f"supports bits {bits}{fp8}; got bits {config.bits}"
    return None


def validate(config, where: str) -> None:
    if config.backend not in NAMES:
        raise PolicyError(f"{where}.backend: unknown backend {config.backend!r}; allowed: {', '.join(NAMES)}")
    if getattr(config, "clip", "minmax") != "minmax" and (config.backend != "native" or config.format != "int"):
        raise PolicyError(f"{where}.clip: {config.clip!r} is a native integer-format option (backend native, "
                          f"format int); got backend {config.backend!r}, format {config.format!r}; use clip: minmax")
    s = SUPPORT[config.backend]
    problem = _problem(config, s)
    if problem is not None:
        raise PolicyError(f"{where}: backend {config.backend!r} {problem}")
    if s.package is not None and not _package_present(s.package):
        raise PolicyError(
            f"{where}.backend: backend {config.backend!r} needs the package {s.pip!r}, which is not "
            f"installed (pip install {s.pip}); or use backend: native"
        )
