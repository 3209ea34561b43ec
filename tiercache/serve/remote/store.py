"""The rung logic: a local ``PrefixStore`` in front, the remote tier behind it, one store to the worker.

    store = SharedStore(local, tier, write="turn", remote_rung=False)
    # the PrefixStore interface, unchanged for the worker and persist (``scope=`` included):
    store.lookup(ids) / store.checkout(ids) / store.put(ids, cache, rung=0, oldest=False, release=None)
    store.reserve(need, ids) -> Reservation | None / store.release(reservation) / store.split(reservation, n)
    store.budget / store.ladder / store.entries() / store.records()
    store.stats() -> the local store's stats; hits, misses and cached_tokens count both tiers,
                     ``remote`` holds the tier's own (``RemoteTier.stats``)
    store.close()    queued writes are flushed (bounded), then the local store is closed

What goes where
- Checkout: the local store answers unless the remote tier can give more: when the prompt has
  at least one whole chunk past what the local store holds, the tier is asked (``fetch`` with
  ``beat`` = the local length) and its cache is used if it is longer. The next turn of a
  conversation on the same server never asks Redis.
- ``write: turn``: every cache handed back (``put``) is published first (its new whole chunks
  copied, written in the background), then stored locally. Every server of the model can then
  continue the conversation.
- ``write: demote`` with ``remote`` as the ladder's last rung: nothing is written after a turn;
  an entry that falls off the last local rung is published before it is closed, so a demoted
  entry then lives only in Redis (its whole chunks; the partial last chunk is dropped).
  ``write: turn`` with the rung: published entries are already there, eviction writes the rest.
- Scopes (tenants, ``cache_salt``): the tier's keys of a scope are chained from the scope's
  digest, so another scope's lookup on any server asks for other keys and finds nothing.
"""

from __future__ import annotations

from tiercache.serve.tenants import SHARED


class SharedStore:
    def __init__(self, local, tier, write: str = "turn", remote_rung: bool = False):
        self.local, self.tier = local, tier
        self.write_each_turn = write == "turn"
        if remote_rung:
            local.on_evict = tier.publish  # an entry leaving the last local rung goes to Redis

    @property
    def budget(self) -> dict:
        return self.local.budget

    @property
    def ladder(self) -> list:
        return self.local.ladder

    def lookup(self, ids, scope=SHARED) -> int:
        return self.local.lookup(ids, scope)

    def checkout(self, ids, scope=SHARED):
        held = self.local.lookup(ids, scope)
        cache, n = self.tier.fetch(ids, beat=held, scope=scope)
        if cache is not None:
            return cache, n
        return self.local.checkout(ids, scope)

    def put(self, ids, cache, rung: int = 0, oldest: bool = False, release=None, scope=SHARED) -> bool:
        if self.write_each_turn and not oldest and cache.get_seq_length() == len(ids):
            self.tier.publish(list(ids), cache, scope)  # copies what it needs now: the store may close the cache
        return self.local.put(ids, cache, rung, oldest, release=release, scope=scope)  # the reservation ends first

    def reserve(self, need: dict, ids=None, scope=SHARED):
        return self.local.reserve(need, ids, scope)

    def release(self, reservation) -> None:
        self.local.release(reservation)

    def split(self, reservation, n: int) -> list:
        return self.local.split(reservation, n)

    def entries(self) -> list:
        return self.local.entries()

    def records(self) -> list:
        return self.local.records()

    def stats(self) -> dict:
        s = self.local.stats()
        r = self.tier.stats()
        s["hits"] += r["hits"]
        s["cached_tokens"] += r["cached_tokens"]
        s["remote"] = r
        return s

    def __len__(self) -> int:
        return len(self.local)

    def close(self) -> None:
        try:
            self.tier.close()
        finally:
            self.local.close()
