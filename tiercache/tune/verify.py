"""A policy measured end to end against full precision, on text the calibration did not see.

Interface
    Verifier(model, tokenizer, ids, stretch, passkey=True, tick=None)
        ``ids``: ``[context]`` verification tokens; the last ``stretch`` are scored. Computes once
        the full-precision reference: a no-cache forward's next-token distributions over the
        stretch, and the pass-key samples (``metrics.passkey_samples`` at ``metrics.DEPTHS``, the
        same ``context``) answered through a ``DynamicCache``.
        .measure(policy) -> metrics.Figures
            a ``TieredCache`` from ``policy``: the prefix prefilled through it (chunks of
            ``metrics.PREFILL_CHUNK``), then the stretch teacher-forced one token per step, so each
            prediction reads the cache as decoding does (quantized blocks, residual, sinks, packed
            attention); then each pass-key sample through a fresh cache.
        .forwards(passkey=True) -> int   model calls one ``measure`` makes (for time estimates)
"""

from __future__ import annotations

import torch

from tiercache.cache.compat import cache_arg
from tiercache.tune import metrics


class Verifier:
    @torch.no_grad()
    def __init__(self, model, tokenizer, ids: torch.Tensor, stretch: int, passkey: bool = True, tick=None):
        from transformers import DynamicCache

        if not 1 <= stretch < ids.numel():
            raise ValueError(f"verify: stretch {stretch} must be >= 1 and < the {ids.numel()} verification tokens")
        self.model, self.tokenizer, self.tick = model, tokenizer, tick or (lambda n: None)
        self.ids, self.stretch = ids, stretch
        self.prompt = ids.numel() - stretch
        x = ids.to(model.device)[None]  # [1, T]
        logits = model(input_ids=x, use_cache=False).logits[0, self.prompt - 1 : -1]  # [S, V]
        self.ref_logp = metrics.log_probs(logits)  # [S, V]
        self.targets = ids[self.prompt :].to(model.device)  # [S]
        self.samples = metrics.passkey_samples(tokenizer, ids, ids.numel()) if passkey else []
        self.passkey_ref = None
        if passkey:
            found = sum(metrics.passkey_found(model, tokenizer, DynamicCache(config=model.config), s, k)
                        for s, k in self.samples)
            self.passkey_ref = (int(found), len(self.samples))
            if found == 0:
                self.samples = []

    def forwards(self) -> int:
        return self.stretch + len(self.samples) * (1 + metrics.ANSWER_TOKENS)

    @torch.no_grad()
    def measure(self, policy) -> metrics.Figures:
        from tiercache.cache.tiered import TieredCache

        model = self.model
        cache = TieredCache.from_policy(policy, model.config, context_length=self.ids.numel())
        x = self.ids.to(model.device)[None]  # [1, T]
        for s in range(0, self.prompt, metrics.PREFILL_CHUNK):
            logits = model(input_ids=x[:, s : min(s + metrics.PREFILL_CHUNK, self.prompt)], **cache_arg(cache),
                           use_cache=True).logits[0, -1]  # [V]
        rows = [logits]
        for t in range(self.prompt, self.ids.numel() - 1):
            rows.append(model(input_ids=x[:, t : t + 1], **cache_arg(cache), use_cache=True).logits[0, -1])
            self.tick(1)
        _close(cache)
        logp = metrics.log_probs(torch.stack(rows))  # [S, V]
        passkey = None
        if self.samples:
            found = 0
            for s, k in self.samples:
                c = TieredCache.from_policy(policy, model.config, context_length=self.ids.numel())
                found += metrics.passkey_found(model, self.tokenizer, c, s, k)
                _close(c)
                self.tick(1 + metrics.ANSWER_TOKENS)
            passkey = (int(found), len(self.samples))
        return metrics.figures(self.ref_logp, logp, self.targets, passkey, self.passkey_ref)


def _close(cache) -> None:
    close = getattr(cache, "close", None)
    if callable(close):
        close()
