"""``store.yaml``: the prefix store's memory budget per tier and its demotion ladder.

    budget:                 # bytes each tier may hold for stored conversations (null: no limit)
      device: 256MiB        # the compute device (on a CPU-only server: RAM all the same)
      host: 2GiB            # CPU memory of offloaded caches (``TieredCache.tier_nbytes``)
      disk: 8GiB
    ladder:                 # where a least-recently-used entry goes when its tier is full, in order;
      - offload-cpu.yaml    # each a policy file (relative to this file, else to the working
      - {name: disk, offload: {device: disk}}   # directory) or an inline policy mapping
    block_size: 16          # tokens per radix block (the lookup granularity)
    min_match: 16           # shorter shared prefixes are not worth a fork: prefill from scratch
    remote:                 # optional: chunks in Redis shared by servers (``tiercache.serve.remote.config``)
      url: redis://127.0.0.1:6379/0
      chunk_tokens: 256
      ttl: 1d

``load_store_config(source) -> StoreConfig``: ``source`` is a path, a mapping or ``None`` (the
defaults below). Bad input raises ``PolicyError`` naming ``store.<field>`` and what is allowed.
Rung 0 of the ladder is always the serving policy (``--policy``); ``ladder`` lists the rungs
below it. An entry past the last rung is evicted. The string ``remote`` may be the ladder's last
rung (it needs a ``remote`` section): an entry leaving the last local rung then lives only in
Redis (``StoreConfig.remote_rung``; ``tiercache.serve.remote.store``). Lossless rungs (offload to
host / disk) keep answers identical; lossy ones (quantization) trade exactness of demoted
conversations for room.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from tiercache.errors import PolicyError
from tiercache.planner.footprint import TIERS
from tiercache.policy.schema import Policy, load_policy
from tiercache.policy.fields import parse_size
from tiercache.serve.remote.config import RemoteConfig, parse_remote

DEFAULT = {"budget": {"device": "1GiB", "host": "4GiB", "disk": None},
           "ladder": [{"name": "host", "offload": {"device": "cpu"}}]}
_FIELDS = ("budget", "ladder", "block_size", "min_match", "remote")
REMOTE_RUNG = "remote"


@dataclass(frozen=True)
class StoreConfig:
    budget: dict  # tier -> bytes or None (no limit)
    ladder: tuple[Policy, ...]  # the rungs below the serving policy
    block_size: int = 16
    min_match: int = 16
    remote: RemoteConfig | None = None  # the shared tier (None: none)
    remote_rung: bool = False  # ``remote`` is the ladder's last rung


def load_store_config(source=None) -> StoreConfig:
    base = Path.cwd()
    if source is None:
        data = DEFAULT
    elif isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if not path.is_file():
            raise PolicyError(f"store config {str(path)!r}: no such file")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise PolicyError(f"store config {str(path)!r} is not readable YAML: {e}") from e
        base = path.resolve().parent
    if not isinstance(data, dict):
        raise PolicyError(f"store: expected a mapping with {', '.join(_FIELDS)}, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise PolicyError(f"store: unknown field(s) {unknown}; allowed: {', '.join(_FIELDS)}")
    rungs = _list(data.get("ladder", []) or [])
    remote = parse_remote(data.get("remote"))
    remote_rung = bool(rungs) and rungs[-1] == REMOTE_RUNG
    if remote_rung:
        rungs = rungs[:-1]
        if remote is None:
            raise PolicyError(f"store.ladder[{len(rungs)}]: the {REMOTE_RUNG!r} rung needs a store.remote section "
                              "(url, chunk_tokens, ttl)")
    if REMOTE_RUNG in rungs:
        raise PolicyError(f"store.ladder[{rungs.index(REMOTE_RUNG)}]: {REMOTE_RUNG!r} can only be the last rung")
    if remote is not None and remote.write == "demote" and not remote_rung:
        raise PolicyError("store.remote.write: 'demote' writes entries that leave the ladder's last rung; "
                          f"add {REMOTE_RUNG!r} as the last rung of store.ladder, or use write: turn")
    return StoreConfig(budget=_budget(data.get("budget", DEFAULT["budget"])),
                       ladder=tuple(_rung(r, i, base) for i, r in enumerate(rungs)),
                       block_size=_positive(data.get("block_size", 16), "store.block_size"),
                       min_match=_positive(data.get("min_match", 16), "store.min_match"),
                       remote=remote, remote_rung=remote_rung)


def _budget(value) -> dict:
    if value is None:
        return dict.fromkeys(TIERS)
    if not isinstance(value, dict):
        raise PolicyError(f"store.budget: expected a mapping of tiers ({', '.join(TIERS)}) to sizes, got {value!r}")
    unknown = sorted(set(value) - set(TIERS))
    if unknown:
        raise PolicyError(f"store.budget: unknown tier(s) {unknown}; allowed: {', '.join(TIERS)}")
    return {t: None if value.get(t) is None else int(parse_size(value[t], f"store.budget.{t}")) for t in TIERS}


def _list(value) -> list:
    if not isinstance(value, list):
        raise PolicyError(f"store.ladder: expected a list of policies (files or mappings), got {value!r}")
    return value


def _rung(value, i: int, base: Path) -> Policy:
    where = f"store.ladder[{i}]"
    if isinstance(value, str):
        path = Path(value)
        path = path if path.is_absolute() or not (base / path).is_file() else base / path
        if not path.is_file():
            raise PolicyError(f"{where}: policy file {value!r} not found (relative to {base} or the working directory)")
        value = path
    elif not isinstance(value, dict):
        raise PolicyError(f"{where}: expected a policy file or mapping, got {value!r}")
    try:
        policy = load_policy(value)
    except PolicyError as e:
        raise PolicyError(f"{where}: {e}") from e
    if policy.auto:
        raise PolicyError(f"{where}: auto policies cannot be ladder rungs (a rung must be one concrete form)")
    return policy


def _positive(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{where}: expected a whole number >= 1, got {value!r}")
    return value
