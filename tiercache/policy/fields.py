"""Fields of the policy dataclasses and the one generic loader that builds them from plain data.

Interface
- ``UNSET``: an override field that was not given (distinct from ``null``).
- ``Size``: a byte count (an ``int``); ``parse_size(value, path) -> Size`` accepts ints and strings
  such as ``20GiB``, ``512MB``, ``1.5 GiB``.
- ``build(tp, value, path)``: ``value`` (YAML / dict data) as the type hint ``tp``: frozen
  dataclasses field by field (unknown fields refused), ``Literal``, optional, tuples, ``Size``,
  ``bool``, ``int``, ``float`` (ints accepted), ``str``. Every bad input raises ``PolicyError``
  with the field path, the value and what is allowed (``describe(tp)``).
- ``to_plain(obj)``: the inverse, plain dicts / lists / ints (``UNSET`` fields left out).

The policy module (``tiercache.policy.schema``) declares the dataclasses and their cross-field checks;
this one only walks type hints, so no field is restated anywhere.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal

from tiercache.errors import PolicyError


class _Unset:
    """Marks an override field that was not given (distinct from ``null``)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class Size(int):
    """A byte count; accepts ints and strings like ``20GiB``, ``512MB``, ``1.5 GiB``."""


def parse_size(value: Any, path: str) -> Size:
    if isinstance(value, bool):
        raise PolicyError(f"{path}: expected a size such as 20GiB or a byte count, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)):
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise PolicyError(f"{path}: unknown unit {m.group(2)!r} in {value!r}; allowed: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
        number = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise PolicyError(f"{path}: expected a size such as 20GiB or a byte count, got {value!r}")
    if number < 0:
        raise PolicyError(f"{path}: a size must be >= 0, got {value!r}")
    return Size(number)


def describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args if a is not type(None)) + " or null"
    if origin is tuple:
        return f"a list of {describe(args[0])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({', '.join(f.name for f in dataclasses.fields(tp))})"
    if tp is Size:
        return "a size such as 20GiB"
    return {int: "an integer", str: "a string", bool: "true or false", float: "a number"}.get(tp, str(tp))


def build(tp, value, path: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return build(inner[0], value, path)
    if origin is Literal:
        if value not in args or isinstance(value, bool) != any(isinstance(a, bool) for a in args):
            raise PolicyError(f"{path}: {value!r} is not allowed; allowed: {describe(tp)}")
        return value
    if origin is tuple:
        if value is None:  # an empty YAML section (`overrides:`): no items
            return ()
        if not isinstance(value, (list, tuple)):
            raise PolicyError(f"{path}: expected {describe(tp)}, got {value!r}")
        return tuple(build(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise PolicyError(f"{path}: expected {describe(tp)}, got {value!r}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        for key in value:
            if key not in names:
                raise PolicyError(f"{path}.{key}: unknown field; allowed: {', '.join(names)}")
        return tp(**{k: build(hints[k], v, f"{path}.{k}") for k, v in value.items()})
    if tp is Size:
        return parse_size(value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise PolicyError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PolicyError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise PolicyError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"policy loader: unsupported field type {tp!r} at {path}")


def to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not UNSET}
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Size):
        return int(obj)
    return obj
