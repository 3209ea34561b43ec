"""The prefix store: finished conversations' caches, keyed by token ids, under a budget per tier.

Interface (the store knows caches and token ids, never a model)
    store = PrefixStore(ladder, budget, tier_bytes, block_size=16, min_match=16, tenant_budgets=None)
        ladder      policies, rung 0 first: rung 0 is the serving policy; an entry over budget
                    moves one rung down (``cache.retier(ladder[r + 1])``); past the last, evicted
        budget      {"device" | "host" | "disk": bytes or None}
        tier_bytes  cache -> {tier: bytes} (the server passes ``cache.tier_nbytes()``)
        tenant_budgets  {tenant name: bytes}: what that tenant's entries may hold, all tiers together
    Every lookup, checkout, put and reserve takes ``scope=`` (``tenants.Scope``; default the shared
    scope): an entry is found only by calls of the scope it was put with.
    store.lookup(ids) -> int                  tokens a checkout would reuse; marks that entry used
    store.checkout(ids) -> (cache | None, n)  a cache holding exactly ``ids[:n]`` at rung 0, with
                                              ``n <= len(ids) - 1`` (one token is left to prefill)
    store.put(ids, cache, release=None) -> bool
                                              hand a finished cache back; ``cache.get_seq_length()``
                                              must equal ``len(ids)``, else it is closed, not stored;
                                              ``release``: the request's reservation, ended first
    store.put(ids, cache, rung, oldest=True)  a cache loaded from disk: first in line to go
    store.reserve(need, ids=None) -> Reservation | None
                                              bytes per tier an active request may grow to, held
                                              until released; ``ids``: its prompt (the entry it
                                              will take is not counted twice); None: not now
    store.release(reservation)                the request ended (a second release does nothing)
    store.split(reservation, n) -> [Reservation] * n
                                              a live reservation replaced by ``n`` whose needs add
                                              up to its own, each released on its own (the ``n``
                                              choices of one request, after its checkout)
    store.stats() -> dict                     lock-free: the snapshot every change publishes (counters,
                                              ``demotion_seconds``: time spent demoting, bytes per tier)
    store.entries() -> [(ids, cache, rung)]   oldest first
    store.records() -> [(ids, cache, rung, scope)]   the same, with each entry's scope (persist)
    store.close()
    store.on_evict = fn(ids, cache, scope)    optional: called with an entry leaving the last rung,
                                              before it is closed (the remote rung writes it out)

What it asks of a cache: ``fork()`` (an independent copy), ``crop(n)`` (transformers' convention,
negative removes ``-n`` tokens), ``retier(policy)`` (in place), ``release_transients()`` (free
the buffers only a cache in use needs: called on every put, so an entry counts its own bytes),
``get_seq_length()`` and ``close()``.

Checkout: the entry sharing the longest prefix with ``ids`` (the least demoted, then the most
recently used, when several do). When the request extends the whole entry (the next turn of a
conversation) the entry is *taken* out of the store, no copy; otherwise (an edited message, a
branch) it is forked and the fork cropped to the shared prefix, and the entry stays. A shared
prefix shorter than ``min_match`` tokens is not worth the copy: a miss. A demoted cache is
retiered back to rung 0 before use. If that fails, the request prefills from scratch: a failed
copy leaves the entry as it was, a taken entry that cannot be brought back is dropped (logged).

Put: entries whose ids are a prefix of the new ids are superseded and dropped (the new entry
serves all they could). A put that ends a request's reservation (``release=``) ends it first.

The budget (``docs/serving-store.md``). A tier's total is its entries' bytes plus what live
reservations stand for: a reservation counts its need, and while the entry it will take is still
stored, ``max(need, entry bytes)`` per tier for the two together (the need already covers that
entry once taken). While a tier is over its budget, the least-recently-used entry holding bytes
there (never one a reservation will take) is demoted one rung, or evicted past the last rung; a
failing ``retier`` evicts (logged). ``reserve`` first checks that the reservations alone fit every
tier: if they do not, it changes nothing and answers None (emptying the store would not help).

Tenants. Each scope has its own trie, so a lookup never sees another scope's entries (and a
``cached_tokens`` of 0 tells a client nothing about them); the LRU line and the tier budgets are
shared. A tenant with a budget (``tenant_budgets``) is held to it at every put: while its entries'
bytes (every tier, reservations not counted) are over it, its least-recently-used entry that no
reservation will take is evicted, never another tenant's (``tenant_evictions``, also counted in
``evictions``).

The reservations and the per-tier totals they enter are ``tiercache.serve.reservations``.

All methods hold one lock; in the server, the store's own thread calls them
(``tiercache.serve.keeper``), never the step. ``stats()`` takes no lock: the HTTP side reads a
snapshot that every change publishes (a scrape never waits for a retier).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tiercache.planner.footprint import TIERS
from tiercache.serve.radix import BlockTrie
from tiercache.serve.reservations import Ledger, Reservation
from tiercache.serve.tenants import SHARED, Scope

log = logging.getLogger("tiercache.serve")


@dataclass(eq=False)
class Entry:
    ids: tuple
    cache: object
    rung: int
    bytes: dict = field(default_factory=dict)
    tick: int = 0  # when last used
    scope: Scope = SHARED  # who may find it

    @property
    def tier(self) -> str:
        """The tier holding most of its bytes (``device`` when it holds none)."""
        return max(TIERS, key=lambda t: (self.bytes.get(t, 0), -TIERS.index(t)))


class PrefixStore:
    def __init__(self, ladder, budget: dict, tier_bytes, block_size: int = 16, min_match: int = 16,
                 tenant_budgets: dict | None = None):
        if not ladder:
            raise ValueError("the ladder needs at least rung 0 (the serving policy)")
        self.ladder = list(ladder)
        self.budget = {t: budget.get(t) for t in TIERS}
        self.tier_bytes = tier_bytes
        self.min_match = min_match
        self.tenant_budgets = dict(tenant_budgets or {})
        self._block = block_size
        self._tries: dict[Scope, BlockTrie] = {}  # one per scope holding entries
        self._lru: OrderedDict[Entry, None] = OrderedDict()  # oldest first
        self._ledger = Ledger()  # the live reservations
        self._lock = threading.RLock()
        self._clock = itertools.count(1)
        self.on_evict = None  # fn(ids, cache, scope): an entry evicted past the last rung (remote/store.py)
        self.counters = dict.fromkeys(("hits", "misses", "cached_tokens", "demotions", "evictions",
                                       "tenant_evictions", "superseded", "rejected"), 0)
        self.counters["demotion_seconds"] = 0.0  # time spent in retier moving entries down
        self._snapshot: dict = {}
        self._publish()

    @contextlib.contextmanager
    def _locked(self):
        """The lock, and a fresh snapshot for ``stats()`` when the change is done."""
        with self._lock:
            try:
                yield
            finally:
                self._publish()

    # -- lookups ---------------------------------------------------------------------------------
    def _trie(self, scope: Scope) -> BlockTrie:
        if scope not in self._tries:
            self._tries[scope] = BlockTrie(self._block)
        return self._tries[scope]

    def _best(self, ids, scope: Scope) -> tuple[Entry | None, int]:
        trie = self._tries.get(scope)
        if trie is None:
            return None, 0
        keys, n = trie.longest(ids)
        use = min(n, len(ids) - 1)
        if not keys or use < self.min_match:
            return None, 0
        return max(keys, key=lambda e: (-e.rung, e.tick)), use

    def _touch(self, entry: Entry) -> None:
        entry.tick = next(self._clock)
        self._lru.move_to_end(entry)

    def lookup(self, ids, scope: Scope = SHARED) -> int:
        with self._locked():
            entry, use = self._best(ids, scope)
            if entry is not None:
                self._touch(entry)
            return use

    def checkout(self, ids, scope: Scope = SHARED):
        with self._locked():
            entry, use = self._best(ids, scope)
            if entry is None:
                return self._miss()
            taken = use == len(entry.ids)  # the request extends the whole entry: take it, no copy
            if taken:
                self._remove(entry)
            else:  # a branch: copy and crop, the entry stays
                self._touch(entry)
            cache = entry.cache if taken else None
            try:
                if not taken:
                    cache = entry.cache.fork()
                    cache.crop(use - cache.get_seq_length())  # negative: drop the tokens past the shared prefix
                if entry.rung != 0:
                    cache.retier(self.ladder[0])
            except Exception as e:  # noqa: BLE001 - never serve a doubtful cache
                log.error("store: a stored entry of %d tokens could not be checked out (%s); %s", len(entry.ids), e,
                          "dropped" if taken else "prefilling instead")
                if cache is not None:
                    cache.close()
                return self._miss()
            if cache.get_seq_length() != use:
                log.error("store: a checked-out cache holds %d tokens, %d expected; not used",
                          cache.get_seq_length(), use)
                cache.close()
                return self._miss()
            self.counters["hits"] += 1
            self.counters["cached_tokens"] += use
            return cache, use

    def _miss(self):
        self.counters["misses"] += 1
        return None, 0

    # -- hand back -------------------------------------------------------------------------------
    def put(self, ids, cache, rung: int = 0, oldest: bool = False, release: Reservation | None = None,
            scope: Scope = SHARED) -> bool:
        ids = tuple(int(i) for i in ids)
        with self._locked():
            if release is not None:
                self.release(release)
            if cache.get_seq_length() != len(ids) or not ids:
                log.error("store: refusing a cache of %d tokens recorded with %d token ids",
                          cache.get_seq_length(), len(ids))
                self.counters["rejected"] += 1
                cache.close()
                return False
            for old in self._trie(scope).prefixes_of(ids):
                self._remove(old)
                if old.cache is not cache:
                    old.cache.close()
                self.counters["superseded"] += 1
            cache.release_transients()  # workspace, prefetch slots: not part of what is kept
            entry = Entry(ids, cache, rung, self.tier_bytes(cache), 0 if oldest else next(self._clock), scope)
            self._trie(scope).insert(ids, entry)
            self._lru[entry] = None
            if oldest:
                self._lru.move_to_end(entry, last=False)
            self._enforce()
            self._enforce_tenant(scope.tenant)
            return entry in self._lru

    # -- budget ----------------------------------------------------------------------------------
    def reserve(self, need: dict, ids=None, scope: Scope = SHARED) -> Reservation | None:
        with self._locked():
            r = Reservation({t: int(need.get(t, 0)) for t in TIERS})
            if ids is not None:
                entry, use = self._best(ids, scope)
                if entry is not None:
                    self._touch(entry)  # the entry it will use goes last in the LRU line
                    if use == len(entry.ids) and entry not in self._ledger.pinned(self._lru):
                        r.entry = entry  # it will be taken: counted with the need, never demoted meanwhile
            self._ledger.add(r)
            if not self._floor_fits() or not self._enforce():
                self._ledger.drop(r)  # reservations alone do not fit: nothing is touched
                return None
            return r

    def release(self, reservation: Reservation) -> None:
        with self._locked():
            if not isinstance(reservation, Reservation):
                raise TypeError(f"release() takes the Reservation that reserve() returned, got {reservation!r}")
            if not reservation.released:
                self._ledger.drop(reservation)

    def split(self, reservation: Reservation, n: int) -> list[Reservation]:
        """``reservation`` ends and ``n`` take its place, their needs adding up to its need exactly.
        Called once the request's checkout is done: no part stands for a stored entry."""
        with self._locked():
            if not isinstance(reservation, Reservation):
                raise TypeError(f"split() takes the Reservation that reserve() returned, got {reservation!r}")
            if reservation.released:
                raise ValueError("split() of a reservation already released")
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"split() into {n!r} parts; a positive int is allowed")
            parts = self._ledger.split(reservation, n)
            self._enforce()  # an entry it stood for, if still stored, now counts on its own
            return parts

    def _floor_fits(self) -> bool:
        """Whether the reservations alone fit every tier (what no demotion or eviction can lower)."""
        floor = self._ledger.held(self._lru)
        return all(self.budget[t] is None or floor[t] <= self.budget[t] for t in TIERS)

    def _enforce(self) -> bool:
        """Demote / evict LRU entries until every tier fits; False if what is left cannot be moved."""
        while True:
            totals = self._ledger.totals(self._lru)
            over = [t for t in TIERS if self.budget[t] is not None and totals[t] > self.budget[t]]
            if not over:
                return True
            pinned = self._ledger.pinned(self._lru)
            victim = next((e for e in self._lru if e not in pinned and any(e.bytes.get(t, 0) > 0 for t in over)), None)
            if victim is None:
                return False
            self._demote(victim)

    def _enforce_tenant(self, tenant: str) -> None:
        """Evict ``tenant``'s LRU entries (never one a reservation will take) until they fit its budget."""
        budget = self.tenant_budgets.get(tenant)
        if budget is None:
            return
        pinned = self._ledger.pinned(self._lru)
        mine = [e for e in self._lru if e.scope.tenant == tenant]  # oldest first
        held = sum(sum(e.bytes.values()) for e in mine)
        for victim in mine:
            if held <= budget:
                return
            if victim in pinned:
                continue
            held -= sum(victim.bytes.values())
            self.counters["tenant_evictions"] += 1
            self._evict(victim)

    def _demote(self, entry: Entry) -> None:
        if entry.rung + 1 < len(self.ladder):
            start = time.perf_counter()
            try:
                entry.cache.retier(self.ladder[entry.rung + 1])
                self.counters["demotion_seconds"] += time.perf_counter() - start
                entry.rung += 1
                entry.bytes = self.tier_bytes(entry.cache)
                self.counters["demotions"] += 1
                return
            except Exception as e:  # noqa: BLE001 - cannot demote: evict instead
                log.error("store: demoting an entry of %d tokens to rung %d failed (%s); evicting it",
                          len(entry.ids), entry.rung + 1, e)
        self._evict(entry)

    def _evict(self, entry: Entry) -> None:
        self._remove(entry)
        if self.on_evict is not None:
            try:
                self.on_evict(entry.ids, entry.cache, entry.scope)
            except Exception as e:  # noqa: BLE001 - the eviction goes on
                log.error("store: handing an evicted entry of %d tokens on failed (%s)", len(entry.ids), e)
        entry.cache.close()
        self.counters["evictions"] += 1

    def _remove(self, entry: Entry) -> None:
        trie = self._tries.get(entry.scope)
        if trie is not None:
            trie.remove(entry.ids, entry)
            if not trie.root.under:  # that scope holds nothing now
                del self._tries[entry.scope]
        self._lru.pop(entry, None)

    # -- reporting -------------------------------------------------------------------------------
    def _publish(self) -> None:
        entries = dict.fromkeys(TIERS, 0)
        stored = dict.fromkeys(TIERS, 0)
        tenants = dict.fromkeys(self.tenant_budgets, 0)
        for e in self._lru:
            entries[e.tier] += 1
            for t in TIERS:
                stored[t] += e.bytes.get(t, 0)
            if e.scope.tenant:
                tenants[e.scope.tenant] = tenants.get(e.scope.tenant, 0) + sum(e.bytes.values())
        self._snapshot = {"entries": entries, "bytes": stored, "reserved": self._ledger.needs(), "budget": dict(self.budget),
                          "tenant_bytes": tenants, **self.counters}  # one assignment: readers see all or none

    def stats(self) -> dict:
        """The state after the last change, without waiting for one in progress (no lock)."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self._snapshot.items()}

    def entries(self) -> list:
        with self._lock:
            return [(e.ids, e.cache, e.rung) for e in self._lru]

    def records(self) -> list:
        with self._lock:
            return [(e.ids, e.cache, e.rung, e.scope) for e in self._lru]

    def __len__(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        with self._locked():
            for e in list(self._lru):
                self._remove(e)
                e.cache.close()
