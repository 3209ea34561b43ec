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

Sampling: ``temperature == 0`` is greedy (argmax); otherwise softmax(logits / temperature),
nucleus-filtered by ``top_p``, drawn with a generator seeded by ``seed`` (random when absent).
"""

from __future__ import annotations

import random
import time

import torch

from tiercache.serve.text import TextStream


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """The next token from ``logits`` ``[V]``."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [V]
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)  # [V]
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p  # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class Sequence:
    def __init__(self, job, worker):
        self.job, self.w = job, worker
        req = job.request
        self.cache = None
        self.cached = 0
        self.generated: list[int] = []
        self.text = TextStream(worker.codec.decode, req.stop)
        self.generator = torch.Generator(device=worker.device)
        self.generator.manual_seed(req.seed % 2**63 if req.seed is not None else random.getrandbits(63))  # any int seeds
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
        self._accept(logits)

    def _accept(self, logits: torch.Tensor) -> None:
        req = self.job.request
        token = pick(logits, req.temperature, req.top_p, self.generator)
        self.generated.append(token)
        if token in self.w.codec.eos_ids:
            return self._finish("stop")
        delta = self.text.push(token)
        if delta:
            self.job.emit("delta", text=delta)
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
            self.job.emit("delta", text=tail)
        self.finish_reason = reason
        self.job.emit("done", finish_reason=reason, usage=self.usage())
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
        if self.w.store is None:
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
