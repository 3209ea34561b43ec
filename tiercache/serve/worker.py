"""The model worker: one thread owns the model and runs every forward pass.

    worker = Worker(model, codec, policy, model_name="tiny", store=store, max_active=4,
                    queue_size=32, timeout=600.0, metrics=None)
    worker.start()
    job = worker.prepare(request, emit)    # tokenize and check (APIError 400/404), no model work
    worker.submit(job)                     # APIError 429 (with Retry-After) when the queue is full
    job.cancel()                           # the client went away: stops at the next token
    worker.stop()

``emit(kind, **data)`` is called on the worker thread: ``("delta", text=...)``, then
``("done", finish_reason=..., usage=...)``, or ``("error", error=APIError)``.

Scheduling: up to ``max_active`` sequences are active; each turn of the loop advances every
active one by one step (a prefill or one decoded token), so a long answer does not hold the
others back. That loop is where a batched forward of several conversations would go. A job is
admitted when the store can reserve the bytes its cache may grow to (prompt + max_tokens, from
the planner); until then it waits at the head of the queue. A request whose cache cannot fit the
budget even alone is refused by ``prepare``, before any work.

Timeouts: a job past ``timeout`` seconds since submission stops with a 504 error (what it had
computed is kept in the store). Any exception in a step fails only that request (500).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from tiercache.cache.compat import cache_arg
from tiercache.serve.errors import APIError
from tiercache.serve.protocol import DEFAULT_MAX_TOKENS, Request
from tiercache.serve.sequence import Sequence

log = logging.getLogger("tiercache.serve")


@dataclass(eq=False)
class Job:
    request: Request
    ids: list
    max_tokens: int
    need: dict
    emit: object
    submitted: float = field(default_factory=time.perf_counter)
    deadline: float = float("inf")
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


def context_length(model, policy) -> int:
    """Tokens the model can attend to: ``max_position_embeddings`` (and a static ``max_length``)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    limits = [getattr(cfg, "max_position_embeddings", None), getattr(policy, "max_length", None)]
    limits = [n for n in limits if isinstance(n, int) and n > 0]
    return min(limits) if limits else 2048


class Worker:
    def __init__(self, model, codec, policy, *, model_name: str, store=None, max_active: int = 4,
                 queue_size: int = 32, timeout: float = 600.0, metrics=None, prefill_chunk: int = 4096):
        from tiercache.models.spec import ModelSpec

        self.model, self.codec, self.policy, self.store = model, codec, policy, store
        self.model_name = model_name
        self.spec = ModelSpec.from_config(model.config)
        self.device = next(model.parameters()).device
        self.context = context_length(model, policy)
        self.max_active, self.timeout, self.metrics = max_active, timeout, metrics
        self.prefill_chunk = prefill_chunk
        self.counters = {"prefilled_tokens": 0, "requests": 0, "failed": 0}
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._waiting: Job | None = None
        self._active: list[Sequence] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-worker", daemon=True)

    # -- the HTTP side ---------------------------------------------------------------------------
    def prepare(self, request: Request, emit) -> Job:
        if request.model != self.model_name:
            raise APIError(404, f"model {request.model!r} not found; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if request.kind == "chat":
            ids = self.codec.chat(request.messages)
        elif isinstance(request.prompt, str):
            ids = self.codec.encode(request.prompt)
        else:
            ids = list(request.prompt)
            bad = [t for t in ids if not 0 <= t < self.codec.vocab_size]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{self.codec.vocab_size - 1})",
                               param="prompt")
        where = "messages" if request.kind == "chat" else "prompt"
        if not ids:
            raise APIError(400, f"{where} encodes to no tokens", param=where)
        room = self.context - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {self.context} tokens "
                           f"(prompt + max_tokens must fit), so the prompt may have at most {self.context - 1}",
                           param=where, code="context_length_exceeded")
        max_tokens = request.max_tokens if request.max_tokens is not None else min(room, DEFAULT_MAX_TOKENS)
        if max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} is past the context: the prompt has {len(ids)} tokens and "
                           f"the context is {self.context}, so max_tokens may be at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        need = self._need(len(ids) + max_tokens)
        job = Job(request, ids, max_tokens, need, emit)
        job.deadline = job.submitted + self.timeout
        return job

    def _need(self, tokens: int) -> dict:
        if self.store is None:
            return {}
        from tiercache.planner.api import human, plan

        need = {t: int(n) for t, n in plan(self.policy, self.spec, 1, tokens).bytes.items()}
        for tier, n in need.items():
            budget = self.store.budget.get(tier)
            if budget is not None and n > budget:
                raise APIError(400, f"this request's KV cache ({tokens} tokens: prompt + max_tokens) needs "
                               f"{human(n)} on the {tier} tier, more than the store's whole {tier} budget of "
                               f"{human(budget)}; lower max_tokens, shorten the conversation or raise the budget",
                               param="max_tokens", code="kv_budget_exceeded")
        return need

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server is busy ({self._queue.maxsize} requests queued); retry shortly",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        self.counters["requests"] += 1

    @property
    def queue_length(self) -> int:
        return self._queue.qsize() + (self._waiting is not None)

    @property
    def active(self) -> int:
        return len(self._active)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- what sequences call ---------------------------------------------------------------------
    def new_cache(self, tokens: int):
        from tiercache.cache.tiered import TieredCache

        return TieredCache.from_policy(self.policy, self.model.config, context_length=tokens)

    def forward(self, ids, cache) -> torch.Tensor:
        """Feed ``ids`` after what ``cache`` holds; the logits of the last one, ``[V]``."""
        with torch.no_grad():
            for start in range(0, len(ids), self.prefill_chunk):
                x = torch.tensor([ids[start:start + self.prefill_chunk]], dtype=torch.long, device=self.device)  # [1, T]
                out = self.model(input_ids=x, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]  # [V]

    def count(self, name: str, n: int) -> None:
        self.counters[name] += n

    def observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._admit()
            if not self._active:
                if self._waiting is None:
                    try:
                        self._waiting = self._queue.get(timeout=0.1)
                    except queue.Empty:
                        pass
                continue
            for seq in list(self._active):
                self._advance(seq)
        self._drain()

    def _admit(self) -> None:
        while len(self._active) < self.max_active:
            job = self._waiting
            if job is None:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    return
            self._waiting = None
            try:
                if not self._admit_one(job):
                    self._waiting = job
                    return
            except Exception as e:  # noqa: BLE001 - the loop must go on
                log.exception("admitting a request failed")
                self.counters["failed"] += 1
                job.emit("error", error=APIError(500, f"could not start: {type(e).__name__}: {e}", code="internal_error"))

    def _admit_one(self, job: Job) -> bool:
        """Start ``job`` (or drop it, answered); False when it must wait for room."""
        if job.cancelled.is_set():
            return True
        if time.perf_counter() > job.deadline:
            job.emit("error", error=APIError(504, f"the request timed out after {self.timeout:g}s in the queue",
                                             code="timeout"))
            return True
        if self.store is not None:
            self.store.lookup(job.ids)  # the entry it will use goes last in the LRU line
            if not self.store.reserve(job.need):
                if self._active:  # room comes back when an active request finishes
                    return False
                job.emit("error", error=APIError(507, "not enough room in the store's budget for this request",
                                                 code="kv_budget_exceeded"))
                return True
        self._active.append(Sequence(job, self))
        return True

    def _advance(self, seq: Sequence) -> None:
        job = seq.job
        try:
            if job.cancelled.is_set():
                seq.stop("cancelled")
            elif time.perf_counter() > job.deadline:
                seq.stop("timeout", APIError(504, f"the request timed out after {self.timeout:g}s", code="timeout"))
            else:
                seq.step()
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            log.exception("request failed")
            self.counters["failed"] += 1
            seq.stop("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", code="internal_error"))
        if seq.done:
            self._active.remove(seq)
            if self.store is not None:
                self.store.release(job.need)

    def _drain(self) -> None:
        err = APIError(503, "the server is shutting down", code="shutting_down")
        for seq in self._active:
            seq.stop("cancelled", err)
        self._active.clear()
        pending = [self._waiting] if self._waiting is not None else []
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            job.emit("error", error=err)
