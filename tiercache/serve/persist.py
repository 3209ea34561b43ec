"""``--persist DIR``: stored entries survive a restart.

    save_entries(store, directory) -> int     on shutdown: every entry, as held (its rung), then
                                              the store is closed; returns how many were saved
    load_entries(store, directory, model_config, vocab_size=None, device=None) -> int
                                              on start: each file loaded (onto ``device``) and checked

One file per entry, ``entry-<n>.tiercache`` (``TieredCache.save(path, token_ids=ids)``: safetensors
with sha256 per tensor, written atomically). Files of an earlier run are replaced as a whole: the
new set is written first, then the old files are removed. On load every file goes through
``TieredCache.load`` (format, model fingerprint, checksums) and must carry token ids matching its
length and the vocabulary; a file that fails any check is logged and deleted, never served.
A loaded entry goes back to the rung whose policy it was saved with (rung 0 when none matches),
least recently used first, and the budget is enforced as each one arrives.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("tiercache.serve")
SUFFIX = ".tiercache"


def save_entries(store, directory) -> int:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    old = set(directory.glob(f"*{SUFFIX}"))
    saved = set()
    for i, (ids, cache, _) in enumerate(store.entries()):  # oldest first: loaded back in this order
        path = directory / f"entry-{i:06d}{SUFFIX}"
        try:
            cache.save(path, token_ids=list(ids))
            saved.add(path)
        except Exception as e:  # noqa: BLE001 - one entry that cannot be saved does not stop the others
            log.error("persist: could not save an entry of %d tokens to %s: %s", len(ids), path, e)
    for path in old - saved:
        path.unlink(missing_ok=True)
    store.close()
    log.info("persist: saved %d entries to %s", len(saved), directory)
    return len(saved)


def load_entries(store, directory, model_config, vocab_size: int | None = None, device=None) -> int:
    from tiercache.cache.tiered import TieredCache

    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        return 0
    loaded = 0
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        try:
            cache = TieredCache.load(path, model_config, device=device)
        except Exception as e:  # noqa: BLE001 - CacheError for a corrupt file; anything else is as bad
            log.error("persist: dropping %s: %s", path, e)
            path.unlink(missing_ok=True)
            continue
        ids = cache.token_ids
        problem = _check(ids, cache.get_seq_length(), vocab_size)
        if problem:
            log.error("persist: dropping %s: %s", path, problem)
            cache.close()
            path.unlink(missing_ok=True)
            continue
        rung = next((r for r, p in enumerate(store.ladder) if p == cache.policy), 0)
        loaded += store.put(ids, cache, rung, oldest=True)
    log.info("persist: loaded %d entries from %s", loaded, directory)
    return loaded


def _check(ids, seen: int, vocab_size) -> str | None:
    if not isinstance(ids, (list, tuple)) or not ids:
        return "it carries no token ids"
    if len(ids) != seen:
        return f"it holds {seen} tokens but records {len(ids)} token ids"
    if vocab_size is not None and not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        return f"its token ids are not all in 0..{vocab_size - 1}"
    return None
