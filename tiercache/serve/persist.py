"""``--persist DIR``: stored entries survive a restart.

    loaded = load_entries(store, directory, model_config, vocab_size=None, device=None)
        on start: each entry of the saved set loaded (onto ``device``), checked, put in the store;
        ``loaded.count`` entries stored, ``loaded.refused``: files kept on disk but not loaded
    save_entries(store, directory, keep=()) -> int
        on shutdown: every entry as held (its rung), plus the files named in ``keep`` (those this
        run refused), committed as one set; then the store is closed; returns how many were saved

The set. ``DIR/manifest.json`` names it: ``{"format": "tiercache-store", "version": 1, "entries":
[{"file": ..., "tokens": n}, ...]}``, oldest first; an entry of a tenant or a ``cache_salt`` also
records its scope (``"tenant"`` and ``"scope"``, the ``Scope.digest``: never the salt), and is
loaded back into that scope only (an entry without them is shared, as written by a server without
tenants). A file kept because the start refused it keeps its scope. Each entry is one file, ``entry-<save>-<n>.tiercache``
(``TieredCache.save(path, token_ids=ids)``: safetensors with sha256 per tensor), with a name no
earlier save used. A save writes every file of the new set, then replaces the manifest atomically
(a temporary file, fsync, rename, fsync of the directory): that rename is the commit. Only then are
the files that the new manifest does not name removed. A save killed at any point leaves the
previous set whole (its manifest and every file it names); files it wrote before dying are named
by no manifest and are removed by the next save. A directory without a manifest (written by an
earlier tiercache), or whose manifest cannot be read, is read as one set of every ``*.tiercache``
file in it, each entry shared (no scope). Each file is itself
written under a temporary name, fsync-ed and renamed (``TieredCache.save``), so no partial file
ever carries an entry's name; the temporary files of a killed save are removed by the next save.
``$TIERCACHE_TEST_PERSIST_PAUSE`` (seconds, tests only) sleeps after each file: a test can kill
the process in the middle of a save. Only plain file names
in ``DIR`` are read: a manifest name that is absolute, holds a separator or ``..``, or is a
symlink to a file outside ``DIR`` is refused (logged, not loaded, not named again); the files'
own headers cannot choose where disk tiers write (``TieredCache.load`` puts them under the
ladder's disk path, the one this server was configured with).

Loading never deletes. A file that fails a check is refused, logged with the reason, and kept: it
is named again by the next save's manifest (``keep``), so a restart with the wrong ``--model`` or
``--policy`` loses nothing; the right one loads it later. The checks: ``TieredCache.load`` (format,
model fingerprint, checksums: a corrupted file is refused and kept too; delete it yourself), token
ids matching the cache's length and the vocabulary, and the policy it was saved with: it must build
the same layers as one rung of this server's ladder (names aside); it is loaded at that rung. A
cache whose policy matches no rung is refused, not guessed at (rung 0 would serve it as if it had
the serving policy's form). Entries are loaded newest first, each placed before the others in the
LRU line, so the order of use survives the restart; the budget is enforced as each one arrives.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from tiercache.lifecycle import bounds

log = logging.getLogger("tiercache.serve")
SUFFIX = ".tiercache"
MANIFEST = "manifest.json"
FORMAT, VERSION = "tiercache-store", 1
PAUSE_ENV = "TIERCACHE_TEST_PERSIST_PAUSE"  # tests only: seconds to sleep after each entry file is written


class Loaded(NamedTuple):
    count: int  # entries put in the store
    refused: list  # file names kept on disk, not loaded (pass them to save_entries as keep)


def save_entries(store, directory, keep=()) -> int:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    before = {r["file"]: r for r in _records(directory)}  # a kept file keeps its record (its scope)
    kept = [before.get(name, {"file": name, "tokens": None}) for name in keep
            if _inside(directory, name) and (directory / name).is_file()]
    saved = []
    records = store.records()
    log.info("persist: saving %d entries to %s", len(records), directory)
    pause = float(os.environ.get(PAUSE_ENV) or 0)
    for i, (ids, cache, _, scope) in enumerate(records):  # oldest first
        name = f"entry-{tag}-{i:06d}{SUFFIX}"
        try:
            cache.save(directory / name, token_ids=list(ids))  # a temporary file, fsync, rename
            saved.append({"file": name, "tokens": len(ids), **_scope_fields(scope)})
        except Exception as e:  # noqa: BLE001 - one entry that cannot be saved does not stop the others
            log.error("persist: could not save an entry of %d tokens to %s: %s", len(ids), directory / name, e)
        if pause > 0:
            time.sleep(pause)
    _commit(directory, {"format": FORMAT, "version": VERSION, "entries": kept + saved})
    named = {r["file"] for r in kept + saved}
    for path in directory.glob(f"*{SUFFIX}"):
        if path.name not in named:  # the previous set's files, and any an interrupted save left
            path.unlink(missing_ok=True)
    for path in directory.glob(".*.tmp"):  # temporary files of a save killed mid-write
        path.unlink(missing_ok=True)
    store.close()
    log.info("persist: saved %d entries to %s%s", len(saved), directory,
             f" (and kept {len(kept)} refused at start)" if kept else "")
    return len(saved)


def _commit(directory: Path, manifest: dict) -> None:
    tmp = directory / f".{MANIFEST}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _scope_fields(scope) -> dict:
    return {"tenant": scope.tenant, "scope": scope.digest} if scope.digest else {}


def _scope_of(record: dict):
    from tiercache.serve.tenants import SHARED, Scope

    tenant, digest = record.get("tenant", ""), record.get("scope", "")
    if not digest:
        return SHARED
    if not (isinstance(tenant, str) and isinstance(digest, str)):
        raise ValueError(f"entry {record.get('file')!r}: tenant and scope must be strings")
    return Scope(tenant, digest)


def _records(directory: Path) -> list[dict]:
    """The committed manifest's entries (``[]`` when there is none or it cannot be read)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        return [r for r in manifest["entries"] if isinstance(r, dict) and isinstance(r.get("file"), str)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _inside(directory: Path, name) -> bool:
    """``name`` is a plain file name whose file (symlinks followed) lies in ``directory``."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name \
            or (os.altsep and os.altsep in name) or "\0" in name:
        return False
    try:
        return (directory / name).resolve().parent == directory.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _the_set(directory: Path) -> list[dict]:
    """Records (``{"file", ...}``) of the committed set, oldest first; names that leave ``directory``
    are dropped (logged)."""
    records = _named(directory)
    for r in records:
        if not _inside(directory, r["file"]):
            log.error("persist: refusing the name %r in %s: not a file of that directory (an absolute path, "
                      "'..', a separator or a symlink out); not loaded, not named again", r["file"], directory)
    return [r for r in records if _inside(directory, r["file"])]


def _named(directory: Path) -> list[dict]:
    path = directory / MANIFEST
    loose = [{"file": name} for name in sorted(p.name for p in directory.glob(f"*{SUFFIX}"))]
    if not path.is_file():
        return loose  # an earlier tiercache's layout: every file is the set (shared)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}, "
                             f"expected {FORMAT!r} version {VERSION}")
        records = [dict(r) for r in manifest["entries"]]
        for r in records:
            _scope_of(r)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.error("persist: %s is not readable (%s); reading every %s file in %s instead (as shared: their "
                  "scopes were in it)", path, e, SUFFIX, directory)
        return loose
    names = [r["file"] for r in records]
    stray = sorted({r["file"] for r in loose} - {n for n in names if isinstance(n, str)})
    if stray:
        log.warning("persist: %d file(s) in %s belong to no committed set (a save was interrupted): ignored, "
                    "removed by the next save", len(stray), directory)
    return records


def load_entries(store, directory, model_config, vocab_size: int | None = None, device=None) -> Loaded:
    from tiercache.cache.tiered import TieredCache

    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        return Loaded(0, [])
    loaded, refused = 0, []
    disk = set().union(*(bounds.offload_paths(p.to_dict()) for p in store.ladder))
    offload_path = next(iter(disk)) if len(disk) == 1 else None  # this server's own disk path (the files' never)

    def refuse(name: str, why: str) -> None:
        log.error("persist: refusing %s (kept on disk, not loaded): %s", directory / name, why)
        refused.append(name)

    for record in reversed(_the_set(directory)):  # newest first: each older one goes before it in the LRU line
        name = record["file"]
        path = directory / name
        if not path.is_file():
            log.error("persist: %s is named by the manifest but missing", path)
            continue
        try:
            cache = TieredCache.load(path, model_config, device=device, offload_path=offload_path)
        except Exception as e:  # noqa: BLE001 - CacheError for another model, a corrupt file ...
            refuse(name, str(e))
            continue
        problem = _check(cache.token_ids, cache.get_seq_length(), vocab_size)
        rung = None if problem else rung_of(store.ladder, cache)
        if rung is None and not problem:
            problem = (f"it was saved with policy {cache.policy.name!r}, whose form matches no rung of this server's "
                       f"ladder ({', '.join(repr(p.name) for p in store.ladder)}); serve with that policy in the "
                       "ladder to load it")
        if problem:
            cache.close()
            refuse(name, problem)
            continue
        loaded += store.put(cache.token_ids, cache, rung, oldest=True, scope=_scope_of(record))
    log.info("persist: loaded %d entries from %s%s", loaded, directory,
             f"; refused and kept {len(refused)}" if refused else "")
    return Loaded(loaded, list(reversed(refused)))


def rung_of(ladder, cache) -> int | None:
    """The rung whose policy builds the same layers as the one ``cache`` holds (names aside), or None."""
    def form(policy):
        try:
            return [_pathless(layer) for layer in type(cache).layer_policies(policy, cache.model)]
        except Exception:  # noqa: BLE001 - a policy that cannot be resolved for this model matches nothing
            return None

    mine = form(cache.policy)
    return next((r for r, p in enumerate(ladder) if p == cache.policy or (mine is not None and form(p) == mine)), None)


def _pathless(layer):
    """A layer policy without its disk path: where the files go is not the form of the layer."""
    if layer.offload is None or layer.offload.path is None:
        return layer
    return dataclasses.replace(layer, offload=dataclasses.replace(layer.offload, path=None))


def _check(ids, seen: int, vocab_size) -> str | None:
    if not isinstance(ids, (list, tuple)) or not ids:
        return "it carries no token ids"
    if len(ids) != seen:
        return f"it holds {seen} tokens but records {len(ids)} token ids"
    if vocab_size is not None and not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        return f"its token ids are not all in 0..{vocab_size - 1}"
    return None
