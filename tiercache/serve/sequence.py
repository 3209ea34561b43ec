"""One request's generation on the worker thread: ``Sequence(job, worker)``.

    seq.step()      the first call prefills (from the longest stored prefix), later ones decode
                    one token each; ``seq.done`` once it has finished
    seq.stop(reason, error=None)   end it early (``cancelled`` / ``timeout`` / ``error``)

What goes back to the store (``hand_back``): the cache and exactly the token ids whose K/V it
holds. The last sampled token has not been through the model yet, so after a normal finish
(``stop`` / ``length``) it is fed once more, after the client has its answer, and the entry
covers the prompt plus every generated token (the next turn's ``cached_tokens`` then covers the
whole answer). A cancelled or timed-out request keeps the prompt plus the tokens generated before
the last one, with no extra forward. A failed one keeps nothing.

Sampling: ``sampling.Sampler`` on this sequence's logits row (penalties, ``logit_bias``,
temperature / ``top_p``, a generator seeded by ``seed``, log-probabilities); the entries it
recorded go out with the text they belong to (``delta`` / ``done`` events carry ``logprobs``).

Choices (``n > 1``): the sequence of choice 0 prefills the prompt once, then forks its cache for
each other choice (``TieredCache.fork``), and each fork draws its own first token from the same
logits with its own sampler, then runs as a sequence of its own (``worker.adopt``), its events
tagged ``index=i``. The store reservation (``job.reservation``, n caches) is split between them
(``store.split``), each choice's share released when it ends; only choice 0 hands its cache back
to the store (``store.put(..., release=)`` ends its share first).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tiercache.serve.errors import APIError
from tiercache.serve.sampling import Sampler
from tiercache.serve.text import TextStream


def _tagged(emit, index: int):
    return lambda kind, **data: emit(kind, index=index, **data)


class Sequence:
    def __init__(self, job, worker, choice: int = 0):
        self.job, self.w, self.choice = job, worker, choice
        req = job.request
        self.cache = None
        self.cached = 0
        self.generated: list[int] = []
        self.text = TextStream(worker.codec.decode, req.stop)
        self.sampler = Sampler(req, worker.codec, worker.device, choice)
        self.done = False
        self.finish_reason = None
        self.t_first = None

    # -- steps -----------------------------------------------------------------------------------
    def step(self) -> None:
        if self.cache is None:
            self._prefill()
        else:
            self._accept(self.w.forward([self.generated[-1]], self.cache))

    def _prefill(self) -> None:
        ids = self.job.ids
        cache, n = self.w.store.checkout(ids) if self.w.store is not None else (None, 0)
        if cache is None:
            cache, n = self.w.new_cache(len(ids) + self.job.max_tokens), 0
        self.cache, self.cached = cache, n
        logits = self.w.forward(ids[n:], cache)
        self.w.count("prefilled_tokens", len(ids) - n)
        self.t_first = time.perf_counter()
        self.w.observe("ttft", self.t_first - self.job.submitted)
        if self.job.request.n > 1:
            self._fork_choices(logits)
        self._accept(logits)

    def _fork_choices(self, logits: torch.Tensor) -> None:
        n = self.job.request.n
        children = []
        try:
            for i in range(1, n):
                job = dataclasses.replace(self.job, reservation=None, emit=_tagged(self.job.emit, i))
                child = Sequence(job, self.w, choice=i)
                child.cache, child.cached, child.t_first = self.cache.fork(), self.cached, self.t_first
                children.append(child)
            # the worker releases each choice's share of the reservation when that choice ends
            shares = self.w.store.split(self.job.reservation, n) if self.job.reservation is not None else ()
        except Exception:  # this request fails whole; its full reservation is released with it
            for child in children:
                child._discard()
            raise
        for seq, share in zip([self, *children], shares):
            seq.job.reservation, seq.job.need = share, share.need
        for child in children:
            try:
                child._accept(logits)
            except Exception as e:  # noqa: BLE001 - this choice fails (and with it the request)
                child.stop("error", APIError(500, f"generation failed: {type(e).__name__}: {e}", code="internal_error"))
            self.w.adopt(child)

    def _accept(self, logits: torch.Tensor) -> None:
        token = self.sampler.pick(logits)
        self.generated.append(token)
        if token in self.w.codec.eos_ids:
            return self._finish("stop")
        delta = self.text.push(token)
        if delta:
            self.job.emit("delta", text=delta, **self.sampler.take())
        if self.text.stopped:
            return self._finish("stop")
        if len(self.generated) >= self.job.max_tokens:
            return self._finish("length")

    # -- endings ---------------------------------------------------------------------------------
    def usage(self) -> dict:
        n = len(self.job.ids)
        return {"prompt_tokens": n, "completion_tokens": len(self.generated),
                "total_tokens": n + len(self.generated), "prompt_tokens_details": {"cached_tokens": self.cached}}

    def _finish(self, reason: str) -> None:
        tail = self.text.finish()
        if tail:
            self.job.emit("delta", text=tail, **self.sampler.take())
        self.finish_reason = reason
        self.job.emit("done", finish_reason=reason, usage=self.usage(), **self.sampler.take())
        if len(self.generated) > 1:
            self.w.observe("decode", (len(self.generated) - 1) / max(time.perf_counter() - self.t_first, 1e-9))
        self.hand_back(feed_last=True)

    def stop(self, reason: str, error=None) -> None:
        """End early: ``error`` (an APIError) is sent; the cache is kept unless ``reason == 'error'``."""
        if self.done:
            return
        if error is not None:
            self.job.emit("error", error=error)
        if reason == "error":
            self._discard()
        else:
            self.hand_back(feed_last=False)

    def hand_back(self, feed_last: bool) -> None:
        self.done = True
        cache, self.cache = self.cache, None
        if cache is None:
            return
        if self.w.store is None or self.choice:  # one entry per request: choice 0's
            return cache.close()
        held = self.job.ids + self.generated[:-1]
        if feed_last and self.generated:
            try:
                self.w.forward([self.generated[-1]], cache)
                held = self.job.ids + self.generated
            except Exception:  # noqa: BLE001 - keep what is consistent
                return cache.close()
        self.w.store.put(held, cache, release=self.job.reservation)  # the reservation ends first

    def _discard(self) -> None:
        self.done = True
        if self.cache is not None:
            self.cache.close()
            self.cache = None
