"""``StoreKeeper``: every store call of the worker, on a thread of its own beside the step.

    keeper = StoreKeeper(worker, store, ready)      ready(seq | None): a job is ready to join the batch
    keeper.start()
    keeper.admit(job)       reserve room (demoting / evicting what must move), check the store out
                            (the local store, or Redis behind it), then ``ready(Sequence)``; a job
                            answered instead (cancelled, 504, 507, 500) gives ``ready(None)``
    keeper.run(fn)          ``fn(store)`` in order with the others (put, release, split)
    keeper.pending          calls handed to ``run`` and not yet done
    keeper.close(timeout) -> bool    jobs not yet admitted get 503; queued calls are done; the
                                     thread ends (True). After that ``run`` calls ``fn`` at once.

Why: a lookup may wait on Redis (EXISTS then MGET, each up to the remote ``timeout``, then decoding
and building the cache), a ``reserve`` or ``put`` may demote entries (``retier``: quantizing,
copying to host memory or to disk), a checkout of a demoted entry retiers it back. None of that
may stall the streams: the step thread only hands work over and takes ready sequences back, so a
request joins the batch once its cache is ready. The store's lock is only ever taken by this
thread (and by ``--persist`` after both threads have ended); ``store.stats()`` takes no lock.

Order. Calls run in the order they were handed over, and before the next admission; admissions
are first in, first out. A job whose reservation does not fit waits at the head while other
reservations are live (room comes back when they end: it is retried after each call), and is
refused with 507 when none is (the store alone cannot hold it). A job cancelled or past its
deadline while it waits is answered at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from tiercache.serve.errors import APIError

log = logging.getLogger("tiercache.serve")


class StoreKeeper:
    def __init__(self, worker, store, ready):
        self.w, self.store, self._ready = worker, store, ready
        self._cond = threading.Condition()
        self._calls: deque = deque()
        self._jobs: deque = deque()
        self._blocked = False  # the head job waits for a reservation to end
        self._closing = False
        self._open = False  # the thread takes calls (between start and its end)
        self.pending = 0
        self._thread = threading.Thread(target=self._loop, name="tiercache-store", daemon=True)

    # -- the worker's side -----------------------------------------------------------------------
    def start(self) -> None:
        self._open = True
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def admit(self, job) -> None:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def run(self, fn) -> None:
        with self._cond:
            if self._open:
                self._calls.append(fn)
                self.pending += 1
                self._cond.notify()
                return
        self._call(fn)  # not running (before start, after close): nothing else touches the store

    def close(self, timeout: float = 10.0) -> bool:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                kind, item = self._next()
                if kind is None:
                    return
            if kind == "call":
                self._call(item)
                with self._cond:
                    self.pending -= 1
                    self._blocked = False  # a call may have ended a reservation: retry the head
                continue
            done = self._expired(item) if kind == "check" else self._admit(item)
            with self._cond:
                if done:
                    self._jobs.popleft()
                    self._blocked = False
                elif kind == "job":
                    self._blocked = True

    def _next(self):
        """Under the lock: ("call", fn), ("job", head), ("check", head) or (None, None): end."""
        while True:
            if self._calls:
                return "call", self._calls.popleft()
            if self._jobs and (self._closing or not self._blocked):
                return "job", self._jobs[0]
            if self._closing:
                self._open = False  # from now on run() calls at once, on the caller's thread
                return None, None
            if not self._cond.wait(timeout=0.1) and self._jobs:
                return "check", self._jobs[0]  # a waiting head: cancelled or past its deadline?

    def _call(self, fn) -> None:
        try:
            fn(self.store)
        except Exception:  # noqa: BLE001 - the store's own failures are logged; the keeper goes on
            log.exception("store: a call failed")

    def _expired(self, job) -> bool:
        if job.cancelled.is_set():
            self._ready(None)
            return True
        if time.perf_counter() > job.deadline:
            job.emit("error", error=APIError(504, f"the request timed out after {self.w.timeout:g}s in the queue",
                                             code="timeout"))
            self._ready(None)
            return True
        return False

    def _admit(self, job) -> bool:
        """Start ``job`` (or answer it); False when it must wait for room."""
        if self._closing:
            job.emit("error", error=APIError(503, "the server is shutting down", code="shutting_down"))
            self._ready(None)
            return True
        if self._expired(job):
            return True
        from tiercache.serve.sequence import Sequence

        try:
            job.reservation = self.store.reserve(job.need, job.ids, scope=job.scope)  # the entry it will take is counted once
            if job.reservation is None:
                if any(self.store.stats()["reserved"].values()):  # room comes back when those end
                    return False
                job.emit("error", error=APIError(507, "not enough room in the store's budget for this request",
                                                 code="kv_budget_exceeded"))
                self._ready(None)
                return True
            seq = Sequence(job, self.w)
            seq.checkout()
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            log.exception("admitting a request failed")
            self.w.count("failed", 1)
            if job.reservation is not None:
                self.store.release(job.reservation)
            job.emit("error", error=APIError(500, f"could not start: {type(e).__name__}: {e}", code="internal_error"))
            self._ready(None)
            return True
        self._ready(seq)
        return True
