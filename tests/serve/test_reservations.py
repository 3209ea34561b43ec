"""The prefix store's reservations (``tiercache.serve.reservations``): what they stand for per tier."""

import pytest

from tiercache.serve.reservations import Ledger, Reservation


class Entry:
    """A stored entry as the ledger sees it: its bytes per tier (hashed by identity, as the store's)."""

    def __init__(self, **bytes_):
        self.bytes = bytes_


def test_a_reservation_counts_the_larger_of_its_need_and_the_entry_it_will_take():
    a, b = Entry(device=100, host=50), Entry(host=30)
    ledger = Ledger()
    ledger.add(Reservation({"device": 40, "host": 80}, entry=a))
    stored = [a, b]
    assert ledger.pinned(stored) == {a}
    assert ledger.held(stored) == {"device": 100, "host": 80, "disk": 0}
    assert ledger.totals(stored) == {"device": 100, "host": 110, "disk": 0}  # b counted on its own, a once
    assert ledger.needs() == {"device": 40, "host": 80, "disk": 0}
    # once its entry is no longer stored (taken out), only the need counts
    assert ledger.pinned([b]) == set() and ledger.totals([b]) == {"device": 40, "host": 110, "disk": 0}


@pytest.mark.parametrize("n", [1, 3, 7])
def test_split_parts_add_up_to_the_need_and_replace_it(n):
    ledger, r = Ledger(), Reservation({"device": 100, "host": 7, "disk": 0})
    other = Reservation({"device": 1})
    ledger.add(r), ledger.add(other)
    parts = ledger.split(r, n)
    assert len(parts) == n and r.released and not any(p.released for p in parts)
    assert {t: sum(p.need[t] for p in parts) for t in r.need} == r.need
    assert max(p.need["device"] for p in parts) - min(p.need["device"] for p in parts) <= 1
    assert ledger.needs() == {"device": 101, "host": 7, "disk": 0}
    for p in parts:
        ledger.drop(p)
    assert ledger.needs() == {"device": 1, "host": 0, "disk": 0}
