"""Measure one cache setup: speed, bytes, memory and quality, on one model and one text.

Interface
- ``Reference.compute(model, ids, context, new_tokens)``: the full-precision reference, computed
  once per run: per-token NLL and top-1 of a no-cache forward pass, and the greedy tokens of a
  ``DynamicCache`` decode.
- ``measure(setup, model, ids, context, new_tokens, ref, repeats=1, tick=None) -> dict``: one row:
  ``prefill_tok_s``, ``decode_tok_s`` (the fastest of ``repeats`` runs), ``cache_bytes``
  ({place: bytes} after ``context + new_tokens`` tokens), ``cache_total``, ``memory`` (peak CUDA
  bytes, or process RSS on CPU) and ``memory_kind``, ``ppl``, ``ppl_delta`` (vs the reference),
  ``top1_agreement`` (teacher-forced argmax vs the reference's), ``greedy_agreement`` and ``greedy_prefix`` (free-running greedy
  tokens vs the reference's), ``seconds``; ``note`` holds the error if the setup failed.
  ``tick(n)`` is called as decode steps complete (for a progress bar). ``ValueError`` (before
  anything runs) unless ``context``, ``new_tokens`` and ``repeats`` are >= 1 and ``ids`` has at
  least one token after the prompt.
- ``completed(row) -> bool``: the row has every measurement (not skipped, nothing failed).

``ids`` is ``[T]``: the first ``context`` tokens are the prompt; the rest is the continuation
scored by teacher forcing. Each setup is warmed up (a 256-token prefill and a few decode steps,
enough to make quantizing caches quantize) outside the timings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tiercache.bench import quality
from tiercache.bench.setups import Setup, cache_nbytes
from tiercache.compat import cache_arg

WARMUP_PROMPT, WARMUP_STEPS = 256, 4


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy(model, cache, prompt: torch.Tensor, steps: int, tick=None) -> tuple[list[int], float, float]:
    """Prefill ``prompt`` [T] then ``steps`` one-token decode steps; (tokens, prefill_s, decode_s)."""
    x = prompt.to(model.device)[None]  # [1, T]
    _sync(model.device)
    t0 = time.perf_counter()
    logits = model(input_ids=x, **cache_arg(cache), use_cache=True).logits[:, -1]  # [1, V]
    nxt = logits.argmax(-1, keepdim=True)  # [1, 1]
    _sync(model.device)
    t1 = time.perf_counter()
    tokens = [nxt]
    for _ in range(steps):
        logits = model(input_ids=nxt, **cache_arg(cache), use_cache=True).logits[:, -1]  # [1, V]
        nxt = logits.argmax(-1, keepdim=True)  # [1, 1]
        tokens.append(nxt)
        if tick:
            tick(1)
    _sync(model.device)
    t2 = time.perf_counter()
    return torch.cat(tokens, 1)[0].tolist(), t1 - t0, t2 - t1


@dataclass
class Reference:
    nll: torch.Tensor  # [M]
    top1: torch.Tensor  # [M]
    tokens: list[int]  # [new_tokens + 1]

    @property
    def ppl(self) -> float:
        return quality.perplexity(self.nll)

    @classmethod
    def compute(cls, model, ids: torch.Tensor, context: int, new_tokens: int) -> "Reference":
        from transformers import DynamicCache

        nll, top1 = quality.reference(model, ids, context)
        tokens, _, _ = greedy(model, DynamicCache(config=model.config), ids[:context], new_tokens)
        return cls(nll, top1, tokens)


def _memory(device) -> tuple[int, str]:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda peak"
    import psutil

    return psutil.Process().memory_info().rss, "rss"


def completed(row: dict) -> bool:
    """True when ``measure`` got every measurement of the row (the setup ran and nothing failed)."""
    return all(k in row for k in ("decode_tok_s", "cache_total", "ppl", "greedy_prefix"))


def measure(setup: Setup, model, ids: torch.Tensor, context: int, new_tokens: int, ref: Reference,
            repeats: int = 1, tick=None) -> dict:
    for name, value in (("context", context), ("new_tokens", new_tokens), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"measure: {name} must be an integer >= 1, got {value!r}")
    if ids.numel() <= context:
        raise ValueError(f"measure: ids has {ids.numel()} tokens; it needs more than context={context} "
                         "(the tokens after the prompt are scored)")
    row = {"name": setup.name, "kind": setup.kind, "source": setup.source, "note": setup.note}
    if setup.make is None:
        return row
    t_start = time.perf_counter()
    device = model.device
    try:
        cache = setup.make()
        greedy(model, cache, ids[: min(WARMUP_PROMPT, context)], WARMUP_STEPS)  # warm-up, untimed
        _close(cache)
        del cache
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prefill_s = decode_s = float("inf")
        for _ in range(repeats):  # the fastest of each phase is kept
            cache = setup.make()
            tokens, p_s, d_s = greedy(model, cache, ids[:context], new_tokens, tick)
            prefill_s, decode_s = min(prefill_s, p_s), min(decode_s, d_s)
            row["cache_bytes"] = cache_nbytes(cache)
            row["shared_total"] = sum(cache.shared_nbytes().values()) if hasattr(cache, "shared_nbytes") else 0
            row["memory"], row["memory_kind"] = _memory(device)
            _close(cache)
            del cache
        row.update(prefill_s=prefill_s, decode_s=decode_s, prefill_tok_s=context / prefill_s,
                   decode_tok_s=new_tokens / decode_s, cache_total=sum(row["cache_bytes"].values()))
        cache = setup.make()
        nll, top1 = quality.decode_nll(model, cache, ids, context, tick)
        _close(cache)
        del cache
        ppl = quality.perplexity(nll)
        row.update(ppl=ppl, ppl_delta=ppl - ref.ppl, top1_agreement=quality.agreement(top1, ref.top1),
                   greedy_agreement=quality.agreement(tokens, ref.tokens),
                   greedy_prefix=quality.prefix_match(tokens, ref.tokens))
    except Exception as e:  # noqa: BLE001 - a failing setup is a row note, not a crash
        row["note"] = f"failed: {type(e).__name__}: {e}".splitlines()[0][:200]
    row["seconds"] = time.perf_counter() - t_start
    return row


def _close(cache) -> None:
    close = getattr(cache, "close", None)
    if callable(close):
        close()
