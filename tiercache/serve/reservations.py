"""The prefix store's reservations, and the bytes per tier its budget is checked against.

    Reservation(need, entry=None)   bytes per tier an active request may grow to; ``entry``: the
                                    stored entry it will take out (counted with the need)
    Ledger()                        the live reservations, in the order they were made
        add(r) / drop(r)            a reservation starts / ends (``drop`` marks it released)
        split(r, n) -> [Reservation] * n    ``r`` replaced by ``n`` whose needs add up to its need
        pinned(stored) -> set       the stored entries a live reservation will take
        held(stored) -> {tier: b}   what the reservations stand for: per tier ``max(need, entry bytes)``
                                    (the need already covers the entry once taken)
        totals(stored) -> {tier: b} ``held`` plus the bytes of every other stored entry
        needs() -> {tier: b}        the needs alone (the store's ``reserved`` figure)

``stored`` is the store's collection of entries (each with ``bytes``, ``{tier: bytes}``): a
reservation's entry counts only while it is still stored. Tiers are ``planner.footprint.TIERS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.planner.footprint import TIERS


@dataclass(eq=False)
class Reservation:
    """Bytes per tier an active request may grow to; ``entry``: the stored entry it will take out."""

    need: dict
    entry: object = None
    released: bool = False


class Ledger:
    def __init__(self):
        self._live: list[Reservation] = []

    def add(self, r: Reservation) -> None:
        self._live.append(r)

    def drop(self, r: Reservation) -> None:
        r.released = True
        self._live.remove(r)

    def split(self, r: Reservation, n: int) -> list[Reservation]:
        parts = [Reservation({t: v // n + (i < v % n) for t, v in r.need.items()}) for i in range(n)]
        at = self._live.index(r)
        self._live[at:at + 1] = parts
        r.released = True
        return parts

    def pinned(self, stored) -> set:
        return {r.entry for r in self._live if r.entry is not None and r.entry in stored}

    def held(self, stored) -> dict:
        totals = dict.fromkeys(TIERS, 0)
        for r in self._live:
            e = r.entry.bytes if r.entry is not None and r.entry in stored else {}
            for t in TIERS:
                totals[t] += max(r.need.get(t, 0), e.get(t, 0))
        return totals

    def totals(self, stored) -> dict:
        totals, pinned = self.held(stored), self.pinned(stored)
        for e in stored:
            if e not in pinned:
                for t in TIERS:
                    totals[t] += e.bytes.get(t, 0)
        return totals

    def needs(self) -> dict:
        totals = dict.fromkeys(TIERS, 0)
        for r in self._live:
            for t in TIERS:
                totals[t] += r.need.get(t, 0)
        return totals
