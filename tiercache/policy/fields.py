"""The one generic loader that builds config dataclasses (policies, ``store.yaml``, API keys) from plain data.

Interface
- ``UNSET``: an override field that was not given (distinct from ``null``).
- ``Size``: a byte count (an ``int``); ``parse_size(value, path) -> Size`` accepts ints and strings
  such as ``20GiB``, ``512MB``, ``1.5 GiB``.
- ``Duration``: seconds (a ``float``); ``parse_duration(value, path)`` accepts numbers and strings
  such as ``250ms``, ``30s``, ``5m``, ``12h``, ``1d``.
- ``build(tp, value, path)``: ``value`` (YAML / dict data) as the type hint ``tp``: frozen
  dataclasses field by field (unknown fields refused, required ones asked for), ``Literal``,
  optional, unions (the member whose kind matches the value: a string, a mapping ...), tuples,
  ``dict[K, V]`` (keys built as ``K``), ``Size``, ``Duration``, ``bool``, ``int``, ``float`` (ints
  accepted), ``str``. Every bad input raises ``PolicyError`` with the field path, the value and
  what is allowed (``describe(tp)``).
  A dataclass with a ``from_plain(value, path)`` classmethod is built by it (its own defaults and
  cross-field checks), which builds its fields with ``build_fields``. Field metadata: ``secret``
  (errors never show the value), ``example`` (shown when a required field is missing), ``derived``
  (set by the code, never read from input), ``experimental`` (read from the section's
  ``experimental:`` mapping, ``EXPERIMENTAL``; written there by ``to_plain`` when not the default;
  the field given at the section's top level is still read, with a ``DeprecationWarning``).
- ``read_yaml(path, what)``: a YAML file's data; a key given twice in one mapping is refused.
- ``to_plain(obj)``: the inverse, plain dicts / lists / ints (``UNSET`` fields left out,
  ``experimental`` fields under ``experimental:`` when they differ from their default).

The config modules (``tiercache.policy.schema``, ``tiercache.serve.config``, ``tiercache.serve.tenants``)
declare the dataclasses and their cross-field checks; this one only walks type hints, so no field
is restated anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
import warnings
from typing import Any, Literal

from tiercache.errors import PolicyError


class _Unset:
    """Marks an override field that was not given (distinct from ``null``)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
EXPERIMENTAL = "experimental"  # the mapping that holds a section's ``experimental`` fields

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


class Duration(float):
    """Seconds; accepts numbers and strings like ``500ms``, ``30s``, ``5m``, ``12h``, ``1d``."""


_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = "a duration such as 500ms, 30s, 12h, 1d or seconds"


def parse_duration(value: Any, path: str) -> Duration:
    if isinstance(value, bool):
        raise PolicyError(f"{path}: expected {_DURATION}, got {value!r}")
    if isinstance(value, (int, float)) and math.isfinite(value):
        seconds = float(value)
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h|d)?\s*", value)):
        seconds = float(m.group(1)) * _SECONDS[m.group(2) or "s"]
    else:
        raise PolicyError(f"{path}: expected {_DURATION}, got {value!r}")
    if seconds < 0:
        raise PolicyError(f"{path}: must be >= 0, got {value!r}")
    return Duration(seconds)


def describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args if a is not type(None)) + (" or null" if type(None) in args else "")
    if origin is tuple:
        return f"a list of {describe(args[0])}"
    if origin is dict:
        return f"a mapping of {describe(args[0])} to {describe(args[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({', '.join(f.name for f in _input_fields(tp))})"
    if tp is Size:
        return "a size such as 20GiB"
    if tp is Duration:
        return _DURATION
    return {int: "an integer", str: "a string", bool: "true or false", float: "a number"}.get(tp, str(tp))


def _input_fields(tp) -> list:
    """The fields input may give (``derived`` ones are set by the code)."""
    return [f for f in dataclasses.fields(tp) if f.init and not f.metadata.get("derived")]


def _fits(tp, value) -> bool:
    """Whether ``value`` is of the kind ``tp`` reads (picks the member of a union)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is tuple:
        return isinstance(value, (list, tuple))
    if origin is dict or dataclasses.is_dataclass(tp):
        return isinstance(value, dict) or (dataclasses.is_dataclass(tp) and isinstance(value, tp))
    if tp in (Size, Duration):
        return isinstance(value, (int, float, str)) and not isinstance(value, bool)
    if tp in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def build(tp, value, path: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1:  # several kinds (a file name or a mapping): the one the value is
            chosen = next((a for a in inner if _fits(a, value)), None)
            if chosen is None:
                raise PolicyError(f"{path}: expected {describe(tp)}, got {value!r}")
            return build(chosen, value, path)
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
    if origin is dict:
        if value is None:  # an empty YAML section: no items
            return {}
        if not isinstance(value, dict):
            raise PolicyError(f"{path}: expected {describe(tp)}, got {value!r}")
        out = {}
        for k, v in value.items():
            try:
                key = build(args[0], k, path)
            except PolicyError:
                if typing.get_origin(args[0]) is Literal:
                    raise PolicyError(f"{path}: unknown key, got {k!r}; allowed: {describe(args[0])}") from None
                raise PolicyError(f"{path}: a key must be {describe(args[0])}, got {k!r}") from None
            out[key] = build(args[1], v, f"{path}.{k}")
        return out
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # already built
            return value
        hook = getattr(tp, "from_plain", None)
        return hook(value, path) if hook is not None else build_fields(tp, value, path)
    if tp is Size:
        return parse_size(value, path)
    if tp is Duration:
        return parse_duration(value, path)
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


def experimental_fields(tp) -> list[str]:
    """The fields of ``tp`` read from its ``experimental:`` mapping."""
    return [f.name for f in _input_fields(tp) if f.metadata.get("experimental")]


def _lift_experimental(tp, value: dict, path: str) -> dict:
    """``value`` with its ``experimental:`` mapping's fields at the top level (the dataclass's own
    layout); the old top-level spelling of such a field is read too, with a DeprecationWarning."""
    names = experimental_fields(tp)
    if not names:
        return value
    value = dict(value)
    for k in names:
        if k in value:
            warnings.warn(f"{path}.{k}: an experimental field; write it under {path}.{EXPERIMENTAL} "
                          f"(the top-level spelling will be removed)", DeprecationWarning, stacklevel=4)
    if EXPERIMENTAL not in value:
        return value
    sub = value.pop(EXPERIMENTAL)
    if sub is None:
        return value
    if not isinstance(sub, dict):
        raise PolicyError(f"{path}.{EXPERIMENTAL}: expected a mapping of {', '.join(names)}, got {sub!r}")
    for k, v in sub.items():
        if k not in names:
            raise PolicyError(f"{path}.{EXPERIMENTAL}.{k}: unknown field; allowed: {', '.join(names)}")
        if k in value:
            raise PolicyError(f"{path}.{k}: given both at the top level and under {EXPERIMENTAL}; keep the "
                              f"{EXPERIMENTAL} one")
        value[k] = v
    return value


def build_fields(tp, value, path: str):
    """The dataclass ``tp`` from the mapping ``value``, field by field (no ``from_plain`` hook)."""
    if not isinstance(value, dict):
        raise PolicyError(f"{path}: expected {describe(tp)}, got {value!r}")
    value = _lift_experimental(tp, value, path)
    hints = typing.get_type_hints(tp)
    fields = {f.name: f for f in _input_fields(tp)}
    for key in value:
        if key not in fields:
            allowed = [n for n, f in fields.items() if not f.metadata.get("experimental")]
            if len(allowed) < len(fields):
                allowed.append(f"{EXPERIMENTAL} ({', '.join(experimental_fields(tp))})")
            raise PolicyError(f"{path}.{key}: unknown field; allowed: {', '.join(allowed)}")
    for name, f in fields.items():
        if name not in value and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            example = f.metadata.get("example")
            raise PolicyError(f"{path}.{name}: missing; give {describe(hints[name])}"
                              + (f" such as {example}" if example else ""))
    out = {}
    for k, v in value.items():
        if fields[k].metadata.get("secret"):
            try:
                out[k] = build(hints[k], v, f"{path}.{k}")
            except PolicyError:  # never echo a secret (logs, terminals): say what is allowed only
                raise PolicyError(f"{path}.{k}: expected {describe(hints[k])} (the value is a secret: not shown)") from None
        else:
            out[k] = build(hints[k], v, f"{path}.{k}")
    return tp(**out)


def read_yaml(path, what: str, secret: bool = False):
    """The data of the YAML file ``path`` (``None`` when empty); ``PolicyError`` naming ``what``
    (e.g. "policy file") when it is missing, unreadable, not YAML, or gives a key twice in one mapping.
    ``secret``: a YAML error says the line and column, never the text there (a file of keys)."""
    import yaml

    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise PolicyError(f"{what} {str(path)!r} is a directory; give a YAML file")
    if not path.is_file():
        raise PolicyError(f"{what} {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"{what} {str(path)!r} cannot be read as UTF-8 text: {e}") from e
    try:
        return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        if secret:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise PolicyError(f"{what} {str(path)!r} is not valid YAML{where}: "
                              f"{getattr(e, 'problem', None) or type(e).__name__} (the text is not shown)") from None
        raise PolicyError(f"{what} {str(path)!r} is not valid YAML: {e}") from e


def _unique_key_loader():
    """A yaml SafeLoader that refuses a key given twice in one mapping (YAML would keep the last)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base loader refuses an unhashable key with its own message
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice in one mapping; keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


def to_plain(obj):
    if dataclasses.is_dataclass(obj):
        out, extra = {}, {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is UNSET:
                continue
            if f.metadata.get("experimental"):
                if v != f.default:
                    extra[f.name] = to_plain(v)
            else:
                out[f.name] = to_plain(v)
        if extra:
            out[EXPERIMENTAL] = extra
        return out
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, Size):
        return int(obj)
    if isinstance(obj, Duration):
        return float(obj)
    return obj
