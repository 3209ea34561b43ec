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
defaults below). ``StoreConfig`` is a frozen dataclass read by the generic loader of policies
(``tiercache.policy.fields.build``): bad input raises ``PolicyError`` naming ``store.<field>``, the
value and what is allowed, and a key given twice in one mapping of the file is refused.
An absent ``budget`` is ``DEFAULT_BUDGET``; a ``budget`` section bounds the tiers it names (an
unnamed tier, or ``budget: null``: no limit). Without a source: ``DEFAULT_BUDGET`` and
``DEFAULT_LADDER`` (one lossless rung: host memory); a file without ``ladder`` has no rung below
the serving policy.

Rung 0 of the ladder is always the serving policy (``--policy``); ``ladder`` lists the rungs
below it. An entry past the last rung is evicted. The string ``remote`` may be the ladder's last
rung (it needs a ``remote`` section): an entry leaving the last local rung then lives only in
Redis (``StoreConfig.remote_rung``; ``tiercache.serve.remote.store``). Lossless rungs (offload to
host / disk) keep answers identical; lossy ones (quantization) trade exactness of demoted
conversations for room.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tiercache.errors import PolicyError
from tiercache.planner.footprint import TIERS
from tiercache.policy.fields import Size, build, read_yaml
from tiercache.policy.schema import OffloadPolicy, Policy, load_policy
from tiercache.serve.remote.config import RemoteConfig

Tier = Literal[TIERS]
DEFAULT_BUDGET = {"device": Size(2**30), "host": Size(4 * 2**30), "disk": None}  # a file without ``budget``
DEFAULT_LADDER = (Policy(name="host", offload=OffloadPolicy(device="cpu")),)  # ``--store`` not given
REMOTE_RUNG = "remote"


@dataclass(frozen=True)
class StoreConfig:
    budget: dict[Tier, Size | None] = field(default_factory=lambda: dict(DEFAULT_BUDGET))  # every tier: bytes or None
    ladder: tuple[str | Policy, ...] = ()  # the rungs below the serving policy (as loaded: policies, files read)
    block_size: int = 16
    min_match: int = 16
    remote: RemoteConfig | None = None  # the shared tier (None: none)
    remote_rung: bool = field(default=False, metadata={"derived": True})  # ``remote`` is the ladder's last rung

    @classmethod
    def from_plain(cls, data, path: str = "store", base: Path | None = None) -> "StoreConfig":
        """The generic loader's hook: fields built, rung files read (relative to ``base``, else to
        the working directory), then the cross-field checks."""
        if isinstance(data, dict) and "budget" in data and data["budget"] is None:
            data = {**data, "budget": {}}  # `budget: null`: no limit on any tier
        from tiercache.policy.fields import build_fields

        cfg = build_fields(cls, data, path)
        budget = {t: cfg.budget.get(t) for t in TIERS}
        rungs = list(cfg.ladder)
        remote_rung = bool(rungs) and rungs[-1] == REMOTE_RUNG
        if remote_rung:
            rungs.pop()
            if cfg.remote is None:
                raise PolicyError(f"{path}.ladder[{len(rungs)}]: the {REMOTE_RUNG!r} rung needs a {path}.remote "
                                  "section (url, chunk_tokens, ttl)")
        if REMOTE_RUNG in rungs:
            raise PolicyError(f"{path}.ladder[{rungs.index(REMOTE_RUNG)}]: {REMOTE_RUNG!r} can only be the last rung")
        if cfg.remote is not None and cfg.remote.write == "demote" and not remote_rung:
            raise PolicyError(f"{path}.remote.write: 'demote' writes entries that leave the ladder's last rung; "
                              f"add {REMOTE_RUNG!r} as the last rung of {path}.ladder, or use write: turn")
        for name in ("block_size", "min_match"):
            if getattr(cfg, name) < 1:
                raise PolicyError(f"{path}.{name}: expected a whole number >= 1, got {getattr(cfg, name)!r}")
        ladder = tuple(_rung(r, f"{path}.ladder[{i}]", base or Path.cwd()) for i, r in enumerate(rungs))
        return dataclasses.replace(cfg, budget=budget, ladder=ladder, remote_rung=remote_rung)


def load_store_config(source=None) -> StoreConfig:
    if source is None:  # no --store: the default budget, one lossless rung (host memory)
        return StoreConfig(ladder=DEFAULT_LADDER)
    if isinstance(source, dict):
        return build(StoreConfig, source, "store")
    data = read_yaml(source, "store config")
    return StoreConfig.from_plain(data if data is not None else {}, "store", Path(source).resolve().parent)


def _rung(value, where: str, base: Path) -> Policy:
    """A ladder rung: a policy built inline, or a policy file (relative to ``base``, else the working directory)."""
    if isinstance(value, str):
        path = Path(value)
        path = path if path.is_absolute() or not (base / path).is_file() else base / path
        if not path.is_file():
            raise PolicyError(f"{where}: policy file {value!r} not found (relative to {base} or the working directory)")
        try:
            value = load_policy(path)
        except PolicyError as e:
            raise PolicyError(f"{where} ({value}): {e}") from e
    if value.auto:
        raise PolicyError(f"{where}.auto: auto policies cannot be ladder rungs (a rung must be one concrete form)")
    return value
