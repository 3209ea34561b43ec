"""What the benchmark compares: tiercache policies and transformers' own caches, as ``Setup`` rows.

Interface
- ``Setup(name, kind, source, make, note)``: ``make()`` builds a fresh cache (``None`` when the
  setup cannot run here; ``note`` says why). ``kind`` is ``"tiercache"`` or ``"transformers"``.
- ``policy_setups(sources, config) -> list[Setup]``: one per policy (YAML path, dict or
  ``Policy``); a policy that fails to load becomes a row with a note, not a crash.
- ``demo_policies() -> list``: the demo set (full precision, int4 KIVI, int2 KIVI on every layer,
  offloaded to CPU): ``configs/<name>.yaml`` when it exists, else the inline dict.
- ``baseline_setups(names, config, device) -> list[Setup]``: ``BASELINES`` by name
  (``dynamic``, ``dynamic-offload`` (CUDA only), ``quanto-int4``, ``quanto-int2``, ``hqq-int4``,
  ``hqq-int2``); ``DEFAULT_BASELINES`` is what runs when none are named.
- ``factory(spec, config, device="cpu") -> () -> cache``: a benchmark table's setup spec: a
  ``BASELINES`` name, a config file under ``configs/`` (``"int4-kivi.yaml"``) or anywhere else
  (a path, as given or from the working directory), a whole policy dict (one with a
  ``"quantize"`` key) or a ``QuantizePolicy`` mapping for every layer.
- ``policy_of(spec) -> Policy``: the policy of such a spec that is not a baseline (what
  ``factory`` builds; ``summary.bits_per_element`` counts its bytes).
- ``check_names(names, table, exist=True) -> list[str]``: the setup names a benchmark was asked
  for, each a key of its ``table`` or a policy file (a path ending in ``.yaml`` / ``.yml``, whose
  build spec is the path itself: ``spec_of``); ``ValueError`` names the unknown ones and what is
  allowed, and (``exist``) a policy file that is not there.
- ``is_policy_file(name) -> bool``: a path ending in ``.yaml`` / ``.yml`` that is there.
- ``spec_of(name, table)``: ``table[name]``, or the name of a policy file.
- ``cache_nbytes(cache) -> {place: bytes}``: ``cache.nbytes()`` for tiercache; for other caches
  the bytes of every tensor held by its layers, quantized storage included (tensor subclasses such
  as quanto's are walked through ``__tensor_flatten__``; shared storage is counted once).
- ``cache_tensors(cache) -> [Tensor]``: those tensors themselves (what a memory meter watches).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"

KIVI = {"backend": "native", "group_size": 64, "residual_length": 128, "key_axis": "channel", "value_axis": "token"}
DEMO = [
    ("default", {"name": "default", "description": "full precision, resident (the reference)"}),
    ("int4-kivi", {"name": "int4-kivi", "description": "int4 KIVI: keys per channel, values per token",
                   "quantize": {**KIVI, "bits": 4}}),
    # every layer at int2 (configs/int2-kivi.yaml keeps the first and last layers at int4, which on the
    # tiny model's four layers would leave int2 with int4's bytes)
    ("int2-all", {"name": "int2-all", "description": "int2 KIVI on every layer: keys per channel, values per token",
                  "quantize": {**KIVI, "bits": 2}}),
    ("offload-cpu", {"name": "offload-cpu", "description": "full precision, offloaded to CPU memory",
                     "offload": {"device": "cpu", "prefetch": 1, "pin_memory": True}}),
]

# name -> (QuantizedCache backend, bits, key/value axis) ; axes as transformers' docs use them
_QUANTIZED = {"quanto-int4": ("quanto", 4, 0), "quanto-int2": ("quanto", 2, 0),
              "hqq-int4": ("hqq", 4, 1), "hqq-int2": ("hqq", 2, 1)}
BASELINES = ("dynamic", "dynamic-offload", *_QUANTIZED)
DEFAULT_BASELINES = ("dynamic", "dynamic-offload", "quanto-int4", "quanto-int2", "hqq-int4")


@dataclass
class Setup:
    name: str
    kind: str  # "tiercache" | "transformers"
    source: str  # a YAML path, "inline", or the transformers class used
    make: Callable[[], object] | None
    note: str = ""


def demo_policies(configs_dir: Path | None = None) -> list:
    configs_dir = REPO_CONFIGS if configs_dir is None else Path(configs_dir)
    out = []
    for name, inline in DEMO:
        path = configs_dir / f"{name}.yaml"
        out.append(str(path) if path.is_file() else inline)
    return out


def policy_setups(sources, config) -> list[Setup]:
    from tiercache import TieredCache, load_policy

    rows = []
    for src in sources:
        is_path = isinstance(src, (str, Path))
        label = str(src) if is_path else "inline"
        try:
            policy = load_policy(src)
        except Exception as e:  # noqa: BLE001 - reported as a row note
            name = Path(src).stem if is_path else str(src.get("name", "policy") if isinstance(src, dict) else "policy")
            rows.append(Setup(name, "tiercache", label, None, f"policy error: {e}"))
            continue
        rows.append(Setup(policy.name, "tiercache", label, lambda p=policy: TieredCache.from_policy(p, config)))
    return rows


def baseline_setups(names, config, device: str) -> list[Setup]:
    rows = []
    for name in names:
        if name not in BASELINES:
            rows.append(Setup(name, "transformers", "?", None, f"unknown baseline; allowed: {', '.join(BASELINES)}"))
        elif name == "dynamic":
            rows.append(Setup("DynamicCache", "transformers", "DynamicCache", lambda: _dynamic(config, False)))
        elif name == "dynamic-offload":
            note = "" if str(device).startswith("cuda") else "skipped: offloading=True needs CUDA"
            rows.append(Setup("DynamicCache(offloading)", "transformers", "DynamicCache(offloading=True)",
                              None if note else (lambda: _dynamic(config, True)), note))
        else:
            backend, bits, axis = _QUANTIZED[name]
            src = f"QuantizedCache({backend}, nbits={bits}, axis={axis}, q_group_size=64, residual_length=128)"
            rows.append(Setup(f"QuantizedCache {backend} int{bits}", "transformers", src,
                              lambda b=backend, n=bits, a=axis: _quantized(config, b, n, a)))
    return rows


def _dynamic(config, offloading: bool):
    from transformers import DynamicCache

    return DynamicCache(config=config, offloading=offloading)


def _quantized(config, backend: str, bits: int, axis: int):
    from transformers import QuantizedCache

    return QuantizedCache(backend, config, nbits=bits, axis_key=axis, axis_value=axis, q_group_size=64, residual_length=128)


def factory(spec, config, device="cpu") -> Callable:
    if isinstance(spec, str) and spec in BASELINES:
        return baseline_setups([spec], config, str(device))[0].make
    from tiercache import TieredCache

    policy = policy_of(spec)
    return lambda: TieredCache.from_policy(policy, config)


def policy_of(spec):
    """The ``Policy`` of a non-baseline setup spec: a YAML file under ``configs/``, a whole policy
    mapping, or a ``quantize`` mapping alone."""
    from tiercache import load_policy

    if isinstance(spec, str):
        shipped = REPO_CONFIGS / spec
        return load_policy(str(shipped) if shipped.is_file() else spec)  # else the user's path, named in any error
    return load_policy(spec if "quantize" in spec else {"name": "inline", "quantize": spec})


POLICY_SUFFIXES = (".yaml", ".yml")


def check_names(names, table, exist: bool = True) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in table and not str(n).endswith(POLICY_SUFFIXES)]
    if unknown:
        raise ValueError(f"unknown setup {unknown}; allowed: {', '.join(table)}, or a policy file "
                         f"(a path ending in {' or '.join(POLICY_SUFFIXES)})")
    missing = [n for n in names if n not in table and exist and not is_policy_file(n)]
    if missing:
        raise ValueError(f"policy file not found: {', '.join(missing)}")
    return names


def is_policy_file(name) -> bool:
    return str(name).endswith(POLICY_SUFFIXES) and Path(name).is_file()


def spec_of(name: str, table):
    return table[name] if name in table else name


def cache_nbytes(cache) -> dict[str, int]:
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return {str(k): int(v) for k, v in cache.nbytes().items()}
    out: dict[str, int] = {}
    for t in cache_tensors(cache):
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return out


def cache_tensors(cache) -> list[torch.Tensor]:
    """The plain tensors a cache holds now, each once: a TieredCache's state and shared buffers; for
    transformers' caches every tensor its layers hold (tensor subclasses walked through
    ``__tensor_flatten__``; a tensor shared between two places counted once)."""
    if hasattr(cache, "state_dict") and hasattr(cache, "shared_buffers"):
        return [t for t in (*cache.state_dict().values(), *cache.shared_buffers()) if isinstance(t, torch.Tensor)]
    out: list[torch.Tensor] = []
    seen: set = set()
    for layer in getattr(cache, "layers", []):
        _walk(vars(layer), out, seen)
    return out


def _walk(obj, out: list, seen: set) -> None:
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
            for name in obj.__tensor_flatten__()[0]:  # quanto: _data (packed), _scale, _shift
                _walk(getattr(obj, name), out, seen)
            return
        key = (obj.data_ptr(), obj.numel(), obj.dtype, str(obj.device))
        if obj.numel() and key not in seen:
            seen.add(key)
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, out, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, out, seen)
