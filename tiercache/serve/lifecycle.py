"""The server's life after a signal: ``Lifecycle`` (the app's side) and ``serve(app, ...)`` (uvicorn's).

    life = Lifecycle()                   app.state.lifecycle (``create_app`` makes one)
    life.admit()                         raises APIError 503 (``Retry-After``) once draining
    life.track(pipe, job); life.untrack(pipe)     an admitted request, until its answer is sent
    await life.drain(timeout)            stop admitting, wait up to ``timeout`` s for the tracked
                                         requests, then end the rest with a 503 error event
    serve(app, host, port, shutdown_timeout) -> exit code     uvicorn with the signal handling below

Signals. The first SIGTERM or SIGINT starts a drain: new requests (and ``/health``) answer 503
with ``Retry-After``, the requests already admitted run on for up to ``shutdown_timeout`` seconds,
then each one still running is cancelled: a stream gets a final ``data: {"error": ...}`` event
and ``data: [DONE]``, a non-streaming request a 503 JSON error, so no client sees a cut socket.
Then uvicorn shuts down (listener closed, the app's lifespan ends: worker stopped, store saved
with ``--persist``) and ``serve`` returns 0. A second SIGTERM or SIGINT during that exits at once
(``os._exit(128 + signal)``: nothing more is saved; a ``--persist`` directory keeps its previous
set, ``tiercache.serve.persist``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from tiercache.serve.errors import APIError

log = logging.getLogger("tiercache.serve")
RETRY_AFTER = "5"  # seconds a refused client should wait (another replica has taken over by then)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica", code="shutting_down",
                    headers={"Retry-After": RETRY_AFTER})


class Lifecycle:
    def __init__(self):
        self.draining = False
        self._live: dict[int, tuple] = {}  # id -> (pipe, job)
        self._idle: asyncio.Event | None = None

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def admit(self) -> None:
        if self.draining:
            raise shutting_down()

    def track(self, pipe, job) -> None:
        self._live[id(pipe)] = (pipe, job)

    def untrack(self, pipe) -> None:
        self._live.pop(id(pipe), None)
        if not self._live and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout: float, grace: float = 2.0) -> int:
        """Stop admitting; wait up to ``timeout`` s for the tracked requests; cancel the rest (they
        get a 503 error event) and wait up to ``grace`` s for their answers to go out. Returns how
        many were cancelled."""
        self.draining = True
        self._idle = asyncio.Event()
        if not self._live:
            return 0
        log.info("shutdown: waiting up to %gs for %d request(s)", timeout, len(self._live))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        rest = list(self._live.values())
        if rest:
            log.warning("shutdown: cancelling %d request(s) still running after %gs", len(rest), timeout)
            for pipe, job in rest:
                job.cancel()
                pipe.queue.put_nowait(("error", {"error": shutting_down()}))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        return len(rest)


def serve(app, host: str, port: int, shutdown_timeout: float) -> int:
    """Run ``app`` with uvicorn until a signal (see the module docstring); the exit code."""
    import uvicorn

    life: Lifecycle = app.state.lifecycle

    class Server(uvicorn.Server):
        loop = None
        signalled = False

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):  # runs in the main thread, the loop's
            if self.signalled:
                log.warning("shutdown: second %s: exiting now", signal.Signals(sig).name)
                logging.shutdown()
                os._exit(128 + sig)
            self.signalled = True
            if self.loop is None or not self.started:
                self.should_exit = True  # not serving yet: nothing to drain
                return
            log.info("shutdown: %s received; draining (up to %gs)", signal.Signals(sig).name, shutdown_timeout)
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

        async def _drain(self):
            start = time.monotonic()
            try:
                await life.drain(shutdown_timeout)
            finally:
                log.info("shutdown: drained in %.1fs; stopping", time.monotonic() - start)
                self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
    server = Server(config)
    server.run()
    log.info("shutdown: done")
    return 0 if server.started or server.signalled else 1
