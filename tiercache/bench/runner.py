"""Measure one cache setup: speed, bytes, memory and quality, on one model and one text.

Interface
- ``Reference.compute(model, ids, context, new_tokens)``: the full-precision reference, computed
  once per run: per-token NLL and top-1 of a no-cache forward pass, and the greedy tokens of a
  ``DynamicCache`` decode.
- ``measure_all(setups, model, ids, context, new_tokens, ref, repeats=1, tick=None) -> [dict]``:
  one row per setup: ``prefill_tok_s``, ``decode_tok_s`` (the fastest of ``repeats`` rounds,
  interleaved across setups), ``cache_bytes`` ({place: bytes} after ``context + new_tokens``
  tokens), ``cache_total``, ``peak`` (the setup's own peak of tensor memory while decoding after
  the prompt: its cache plus what the steps allocate, measured alone by an ``AllocationMeter``, the
  same way on every device), ``ppl``, ``ppl_delta`` (vs the reference), ``kld`` (mean KL divergence of the next-token
  distribution from the reference's, ``quality.kld``), ``top1_agreement``
  (teacher-forced argmax vs the reference's), ``greedy_agreement`` and ``greedy_prefix``
  (free-running greedy tokens vs the reference's), ``seconds``; ``note`` holds the error if the
  setup failed. ``measure(setup, ...)``: the same for one setup.
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
from tiercache.bench.setups import Setup, cache_nbytes, cache_tensors
from tiercache.cache.compat import cache_arg

WARMUP_PROMPT, WARMUP_STEPS = 256, 4
PREFILL_CHUNK = 512  # the memory pass prefills in chunks: activations of one chunk, not of the prompt
FOOTPRINT_STEPS = 8  # decode steps the memory pass watches


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
    logp: torch.Tensor | None = None  # [M, V] log-probs of the no-cache pass (the KLD's reference)

    @property
    def ppl(self) -> float:
        return quality.perplexity(self.nll)

    @classmethod
    def compute(cls, model, ids: torch.Tensor, context: int, new_tokens: int) -> "Reference":
        from transformers import DynamicCache

        logp = quality.reference_logp(model, ids, context)  # [M, V]
        nll, top1 = quality.nll_top1(logp, ids, context)
        tokens, _, _ = greedy(model, DynamicCache(config=model.config), ids[:context], new_tokens)
        return cls(nll, top1, tokens, logp)


def completed(row: dict) -> bool:
    """True when the row has every measurement (the setup ran and nothing failed)."""
    return all(k in row for k in ("decode_tok_s", "cache_total", "peak", "ppl", "greedy_prefix"))


def _check_counts(ids: torch.Tensor, context: int, new_tokens: int, repeats: int) -> None:
    for name, value in (("context", context), ("new_tokens", new_tokens), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"measure: {name} must be an integer >= 1, got {value!r}")
    if ids.numel() <= context:
        raise ValueError(f"measure: ids has {ids.numel()} tokens; it needs more than context={context} "
                         "(the tokens after the prompt are scored)")


def _failed(row: dict, e: Exception) -> None:
    row["note"] = f"failed: {type(e).__name__}: {e}".splitlines()[0][:200]


@torch.no_grad()
def _footprint(setup: Setup, model, prompt: torch.Tensor, steps: int) -> dict:
    """The setup's memory, measured alone: a fresh cache holding ``prompt`` (prefilled in chunks of
    ``PREFILL_CHUNK`` so that the prompt's activations do not hide the cache), then ``steps``
    decode steps under an ``AllocationMeter`` that watches the cache's own tensors (one the cache
    frees, say an outgrown buffer, counts as given back). ``peak``: the cache's bytes before the
    steps plus the most extra tensor memory the steps needed at once (its growth, a dequantization
    workspace, the temporaries of a cache that dequantizes or concatenates its history per step)."""
    from tiercache.lifecycle.meter import AllocationMeter

    cache = setup.make()
    x = prompt.to(model.device)[None]  # [1, T]
    for s in range(0, x.shape[1], PREFILL_CHUNK):
        logits = model(input_ids=x[:, s : s + PREFILL_CHUNK], **cache_arg(cache), use_cache=True).logits[:, -1]
    _sync(model.device)
    held = sum(cache_nbytes(cache).values())
    nxt = logits.argmax(-1, keepdim=True)  # [1, 1]
    with AllocationMeter(watch=cache_tensors(cache)) as meter:  # a buffer the cache replaces counts as freed
        for _ in range(steps):
            nxt = model(input_ids=nxt, **cache_arg(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        _sync(model.device)
    _close(cache)
    return {"held_before_decode": held, "peak": held + meter.peak}


def measure_all(setup_list: list[Setup], model, ids: torch.Tensor, context: int, new_tokens: int, ref: Reference,
                repeats: int = 1, tick=None, status=None) -> list[dict]:
    """One row per setup. Untimed, setup by setup: a warm-up, the memory pass (``_footprint``) and
    the quality pass (teacher-forced NLL over ``ids[context:]``). Timed, interleaved: ``repeats``
    rounds, each running every setup once in turn (a fresh cache, the prompt, ``new_tokens`` greedy
    steps), so that a machine's slow moment weighs on every setup alike; the fastest round of each
    phase is kept. A setup that fails keeps its row, with the error in ``note``. ``status(text)``, when
    given, hears what runs now (a progress bar's label)."""
    status = status or (lambda text: None)
    _check_counts(ids, context, new_tokens, repeats)
    rows = [{"name": s.name, "kind": s.kind, "source": s.source, "note": s.note} for s in setup_list]
    started = {s.name: time.perf_counter() for s in setup_list}
    live = []  # (setup, row) still running
    for s, row in zip(setup_list, rows):
        if s.make is None:
            continue
        status(f"{s.name}: memory and quality")
        try:
            cache = s.make()
            greedy(model, cache, ids[: min(WARMUP_PROMPT, context)], WARMUP_STEPS)  # warm-up, untimed
            _close(cache)
            row.update(_footprint(s, model, ids[:context], FOOTPRINT_STEPS))
            cache = s.make()
            logp = quality.decode_logp(model, cache, ids, context, tick)  # [M, V]
            nll, top1 = quality.nll_top1(logp, ids, context)
            _close(cache)
            row.update(ppl=quality.perplexity(nll), top1_agreement=quality.agreement(top1, ref.top1) if ref else None)
            if ref is not None and ref.logp is not None:
                row["kld"] = float(quality.kld(ref.logp, logp).mean())
            if ref is not None:
                row["ppl_delta"] = row["ppl"] - ref.ppl
            live.append((s, row))
        except Exception as e:  # noqa: BLE001 - a failing setup is a row note, not a crash
            _failed(row, e)
    for r in range(repeats):
        for s, row in list(live):
            status(f"timed round {r + 1}/{repeats}: {s.name}")
            try:
                cache = s.make()
                tokens, p_s, d_s = greedy(model, cache, ids[:context], new_tokens, tick)
                row["cache_bytes"] = cache_nbytes(cache)
                row["shared_total"] = sum(cache.shared_nbytes().values()) if hasattr(cache, "shared_nbytes") else 0
                _close(cache)
            except Exception as e:  # noqa: BLE001
                _failed(row, e)
                live.remove((s, row))
                continue
            row["prefill_s"] = min(row.get("prefill_s", float("inf")), p_s)
            row["decode_s"] = min(row.get("decode_s", float("inf")), d_s)
            row["tokens"] = tokens
    for s, row in live:
        tokens = row.pop("tokens")
        row.update(prefill_tok_s=context / row["prefill_s"], decode_tok_s=new_tokens / row["decode_s"],
                   cache_total=sum(row["cache_bytes"].values()))
        if ref is not None:
            row.update(greedy_agreement=quality.agreement(tokens, ref.tokens),
                       greedy_prefix=quality.prefix_match(tokens, ref.tokens))
    for s, row in zip(setup_list, rows):
        row["seconds"] = time.perf_counter() - started[s.name]
        row.pop("tokens", None)
    return rows


def measure(setup: Setup, model, ids: torch.Tensor, context: int, new_tokens: int, ref: Reference,
            repeats: int = 1, tick=None) -> dict:
    """``measure_all`` of one setup."""
    return measure_all([setup], model, ids, context, new_tokens, ref, repeats, tick)[0]


def _close(cache) -> None:
    close = getattr(cache, "close", None)
    if callable(close):
        close()
