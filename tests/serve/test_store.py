"""PrefixStore with fake caches: a fake holds the token ids it has "seen" as its K/V, so every
test can check that a checked-out cache holds exactly the ids it is said to hold."""

from __future__ import annotations

import pytest

from tiercache.serve.store import PrefixStore

BYTES = 10  # per token, at every rung


class FakeCache:
    def __init__(self, ids, place="device", fail_retier=False):
        self.kv = list(ids)
        self.place = place
        self.closed = False
        self.fail_retier = fail_retier
        self.forks = 0

    def fork(self):
        self.forks += 1
        return FakeCache(self.kv, self.place)

    def crop(self, n):  # TieredCache's contract (transformers 5.x): negative removes -n, positive is refused
        if n > 0:
            raise ValueError(f"crop({n}): positive crops are refused")
        self.kv = self.kv[:len(self.kv) + n] if n < 0 else self.kv

    def retier(self, policy):
        if self.fail_retier:
            raise RuntimeError("disk full")
        self.place = policy

    def nbytes(self):
        return {self.place: BYTES * len(self.kv)} if self.kv and not self.closed else {}

    def get_seq_length(self):
        return len(self.kv)

    def close(self):
        self.closed = True

    def release_transients(self):  # the store calls it on every put (a fake holds no workspace)
        self.released = getattr(self, "released", 0) + 1


def tiers(cache):
    return {t: cache.nbytes().get(t, 0) for t in ("device", "host", "disk")}


def make(budget=None, ladder=("device", "host", "disk"), **kw):
    return PrefixStore(list(ladder), budget or {}, tiers, block_size=4, min_match=4, **kw)


def test_next_turn_takes_the_entry():
    store = make()
    turn1 = list(range(10))
    store.put(turn1, stored := FakeCache(turn1))
    assert stored.released == 1
    turn2 = turn1 + [50, 51, 52]
    cache, n = store.checkout(turn2)
    assert n == 10 and cache.kv == turn2[:n]
    assert len(store) == 0  # taken, not copied
    assert store.stats()["hits"] == 1 and store.stats()["cached_tokens"] == 10


def test_edited_message_shares_only_the_tokens_before_the_edit():
    store = make()
    old = list(range(20))
    original = FakeCache(old)
    store.put(old, original)
    edited = old[:9] + [99] + old[10:]
    cache, n = store.checkout(edited)
    assert n == 9 and cache.kv == edited[:9]
    assert cache is not original and original.kv == old and len(store) == 1  # the branch stays


def test_same_prompt_again_leaves_one_token_to_prefill():
    store = make()
    ids = list(range(12))
    store.put(ids, FakeCache(ids))
    cache, n = store.checkout(ids)
    assert n == 11 and cache.kv == ids[:11]


def test_short_shared_prefix_is_a_miss():
    store = make()
    store.put(list(range(12)), FakeCache(range(12)))
    cache, n = store.checkout([0, 1, 2, 77, 78])
    assert cache is None and n == 0 and store.stats()["misses"] == 1


def test_a_longer_turn_supersedes_its_prefix():
    store = make()
    store.put(list(range(8)), a := FakeCache(range(8)))
    store.put(list(range(16)), FakeCache(range(16)))
    assert len(store) == 1 and a.closed and store.stats()["superseded"] == 1


def test_mismatched_cache_is_refused():
    store = make()
    cache = FakeCache(range(5))
    assert not store.put(list(range(6)), cache)
    assert cache.closed and len(store) == 0 and store.stats()["rejected"] == 1


def test_over_budget_demotes_lru_down_the_ladder_then_evicts():
    store = make({"device": 250, "host": 250, "disk": 250})
    convs = [[c * 100 + i for i in range(20)] for c in range(5)]  # 200 bytes each
    caches = []
    for ids in convs:
        caches.append(FakeCache(ids))
        store.put(ids, caches[-1])
        for t in ("device", "host", "disk"):
            assert store.stats()["bytes"][t] <= 250, store.stats()
    s = store.stats()
    assert s["entries"] == {"device": 1, "host": 1, "disk": 1}
    # each put from the second pushes the previous one to host, which pushes host's to disk ...
    assert s["demotions"] == 1 + 2 + 2 + 2 and s["evictions"] == 2
    assert caches[0].closed and caches[1].closed and caches[4].place == "device"
    # the demoted conversation comes back at rung 0, holding its own tokens
    cache, n = store.checkout(convs[2] + [1])
    assert n == 20 and cache.kv == convs[2] and cache.place == "device"
    assert store.checkout(convs[0] + [1]) == (None, 0)  # evicted: prefill from scratch


def test_reserve_makes_room_and_refuses_what_cannot_fit():
    store = make({"device": 300}, ladder=("device",))
    store.put(list(range(20)), a := FakeCache(range(20)))
    assert (r := store.reserve({"device": 200}))  # evicts the entry
    assert a.closed and store.stats()["evictions"] == 1
    assert not store.reserve({"device": 200})  # 200 + 200 > 300 with nothing left to evict
    store.release(r)
    store.release(r)  # a second release does nothing
    assert store.reserve({"device": 300})
    with pytest.raises(TypeError, match="Reservation"):
        store.release({"device": 300})


def test_a_failing_demotion_evicts():
    store = make({"device": 150})
    store.put(list(range(10)), a := FakeCache(range(10), fail_retier=True))
    store.put(list(range(100, 110)), FakeCache(range(100, 110)))
    assert a.closed and store.stats()["evictions"] == 1 and len(store) == 1


def test_a_checkout_that_fails_drops_the_entry():
    store = make()
    ids = list(range(10))
    broken = FakeCache(ids, place="host", fail_retier=True)
    store.put(ids, broken, rung=1)
    assert store.checkout(ids + [5]) == (None, 0)
    assert broken.closed and len(store) == 0


@pytest.mark.parametrize("prefer", ["least-demoted", "most-recent"])
def test_ties_prefer_the_least_demoted_then_most_recent(prefer):
    store = make()
    a, b = list(range(8)) + [1], list(range(8)) + [2]
    store.put(a, ca := FakeCache(a, place="host" if prefer == "least-demoted" else "device"),
              rung=1 if prefer == "least-demoted" else 0)
    store.put(b, cb := FakeCache(b))
    if prefer == "most-recent":
        store.lookup(a)  # touches a
    cache, n = store.checkout(list(range(8)) + [3])
    assert n == 8 and cache.kv == list(range(8))
    assert ca.kv == a and cb.kv == b  # forks: both entries stay intact
    chosen = cb if prefer == "least-demoted" else ca  # b: rung 0 beats rung 1; a: touched last
    assert chosen.forks == 1 and ca.forks + cb.forks == 1 and cache.place == "device"


def test_a_branch_that_cannot_be_copied_keeps_the_entry():
    store = make()
    ids = list(range(12))
    store.put(ids, entry := FakeCache(ids))
    entry.fork = lambda: (_ for _ in ()).throw(RuntimeError("out of memory"))
    assert store.checkout(ids[:8] + [99, 98]) == (None, 0)
    assert len(store) == 1 and not entry.closed  # still there for its own next turn
    cache, n = store.checkout(ids + [1])
    assert cache is entry and n == 12


# -- the budget: what is demoted or evicted, and when (issue 32, "the store keeps what fits") --------------

def test_a_waiting_admission_demotes_and_evicts_nothing():
    """Only reservations are over budget: emptying the store would not make the request fit."""
    store = make({"device": 300, "host": 1000})
    store.put(list(range(10)), a := FakeCache(range(10)))  # 100 bytes
    assert store.reserve({"device": 250})  # an active request
    s = store.stats()
    assert s["demotions"] == 1 and a.place == "host"  # 100 + 250 > 300: a had to go down to make it fit
    store.put(list(range(100, 105)), b := FakeCache(range(100, 105)))  # 50 bytes beside the reservation: fits
    for _ in range(3):  # a waiting request retried at every step of the worker loop
        assert not store.reserve({"device": 100})  # 250 + 100 > 300 whatever the store holds
    s = store.stats()
    assert b.place == "device" and not b.closed and a.place == "host" and not a.closed
    assert s["demotions"] == 1 and s["evictions"] == 0 and s["reserved"]["device"] == 250


def test_stats_do_not_wait_for_the_worker():
    """``/metrics`` reads the store while the worker holds its lock through a long retier."""
    import threading
    from types import SimpleNamespace

    from tiercache.serve.metrics import Metrics

    store = make({"device": 300})
    store.put(list(range(10)), FakeCache(range(10)))
    held, go = threading.Event(), threading.Event()

    def worker():
        with store._lock:  # the worker inside fork / crop / retier
            held.set()
            go.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert held.wait(5)
        got = []
        metrics = Metrics()
        metrics.attach(SimpleNamespace(counters={"requests": 1, "failed": 0, "prefilled_tokens": 10},
                                       queue_length=0, active=1), store)
        reader = threading.Thread(target=lambda: got.append((store.stats(), metrics.render()[0].decode())))
        reader.start()
        reader.join(1.0)
        assert got, "the scrape waited for the worker's lock"
        stats, text = got[0]
        assert stats["bytes"]["device"] == 100 and stats["entries"]["device"] == 1
        assert 'tiercache_store_bytes{tier="device"} 100.0' in text
    finally:
        go.set()
        t.join(10)


def test_the_entry_a_reservation_will_take_is_counted_once_and_kept():
    store = make({"device": 300}, ladder=("device",))
    a = list(range(15))
    store.put(a, ca := FakeCache(a))  # 150 bytes
    r = store.reserve({"device": 200}, a + [1, 2])  # its next turn: 200 covers the entry once taken
    assert r and not ca.closed and store.stats()["evictions"] == 0
    store.put(list(range(100, 110)), b := FakeCache(range(100, 110)))  # 200 + 100: fits
    store.put(list(range(200, 205)), FakeCache(range(200, 205)))  # 350: the least recent one that may go, goes
    assert b.closed and not ca.closed and store.stats()["evictions"] == 1  # a was older, but it is spoken for
    cache, n = store.checkout(a + [1, 2])
    assert cache is ca and n == 15
    cache.kv += [1, 2, 3]  # its prompt's last token and the answer
    store.put(a + [1, 2, 3], cache, release=r)  # the answer: the reservation ends first, then the entry is stored
    assert r.released and store.stats()["reserved"]["device"] == 0 and not ca.closed



def test_split_replaces_a_reservation_by_shares_that_add_up_to_it():
    store = make({"device": 300}, ladder=("device",))
    r = store.reserve({"device": 200, "host": 7})
    parts = store.split(r, 3)  # the three choices of one request (n=3)
    assert r.released and [p.need["device"] for p in parts] == [67, 67, 66] and [p.need["host"] for p in parts] == [3, 2, 2]
    assert store.stats()["reserved"] == {"device": 200, "host": 7, "disk": 0}
    store.release(parts[1])
    assert store.stats()["reserved"]["device"] == 133
    store.put(list(range(10)), FakeCache(range(10)), release=parts[0])  # choice 0's cache goes back
    store.release(parts[2])
    assert store.stats()["reserved"] == {"device": 0, "host": 0, "disk": 0} and len(store) == 1
    with pytest.raises(ValueError, match="already released"):
        store.split(r, 2)
    with pytest.raises(ValueError, match="positive int"):
        store.split(store.reserve({"device": 10}), 0)
