"""The next token of each sequence from its logits row: a ``Sampler(request, codec, device, choice=0)``
per sequence, and ``pick_rows`` for every sampling row of a step at once.

    sampler = Sampler(req, codec, device, choice=i)   # per choice of a request (``n``)
    token = sampler.pick(logits)      # logits: [V], the model's last position for this sequence
    tokens = pick_rows(samplers, logits)   # logits: [R, V], one row per sampler: the batch at once
    sampler.take() -> {"logprobs": [...]} or {}   # entries picked since the last take (to emit)

What ``pick`` does, in OpenAI's order:

1. penalties over the tokens this choice has generated so far (the prompt does not count):
   ``logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)``;
2. ``logit_bias``: ``logit[j] += bias[j]`` (-100 bans a token, +100 all but forces it);
3. ``temperature == 0`` (or so small that ``logits / temperature`` overflows): the argmax;
   otherwise softmax(logits / temperature), nucleus-filtered by ``top_p`` (the most likely token
   is always kept), drawn with this choice's ``torch.Generator``. The generator is seeded from
   ``(seed, choice)`` (random when ``seed`` is absent): the same seed gives the same answer, and
   the choices of one request differ from each other.

Log-probabilities (``req.logprobs`` = the number of alternatives asked for, ``None`` = none)
are ``log_softmax`` of the logits after steps 1-2 at temperature 1 (before temperature and
``top_p``): what the model, penalties and bias make of each token. An entry is
``{"id", "token", "logprob", "bytes", "top": [(id, token, logprob, bytes), ...]}``; an
end-of-sequence token gets none (it is not part of the answer). ``token_text(codec, id)`` is a
token's own text and bytes (a byte-level token that is half a character reads ``\\ufffd`` and
keeps its true byte).
"""

from __future__ import annotations

import hashlib
import random

import torch

MAX_TOP_LOGPROBS = 20


def seed_for(seed: int | None, choice: int) -> int:
    """The generator seed of choice ``choice``: ``seed`` itself for choice 0, a hash of both otherwise."""
    if seed is None:
        return random.getrandbits(63)
    if choice == 0:
        return seed % 2**63  # any int seeds (negative, past 64 bits)
    digest = hashlib.sha256(f"{seed}/{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def token_text(codec, token: int) -> tuple[str, list[int]]:
    """``(text, utf-8 bytes)`` of one token id."""
    if codec.byte_level:
        raw = bytes([token]) if token < 256 else b""
        return codec.decode([token]), list(raw)
    text = codec.decode([token])
    return text, list(text.encode("utf-8"))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` [V] with everything outside the smallest set reaching ``top_p`` zeroed."""
    sorted_p, order = torch.sort(probs, descending=True)  # [V]
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
    keep[0] = True  # the most likely token always (a top_p under float32's smallest number would keep none)
    return torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])


class Sampler:
    def __init__(self, req, codec, device, choice: int = 0):
        self.temperature, self.top_p = req.temperature, req.top_p
        self.presence, self.frequency = req.presence_penalty, req.frequency_penalty
        self.bias = dict(req.logit_bias)  # token id -> added logit
        self.top = req.logprobs  # None: no log-probabilities
        self.codec = codec
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed_for(req.seed, choice))
        self.counts: torch.Tensor | None = None  # [V] tokens generated so far (penalties)
        self._bias_row: torch.Tensor | None = None  # [V]
        self.pending: list[dict] = []

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()  # [V]
        if self.counts is not None:  # penalties, once a token has been generated
            logits = logits - self.frequency * self.counts - self.presence * (self.counts > 0).float()
        if self.bias:
            if self._bias_row is None:
                self._bias_row = torch.zeros_like(logits)
                ids = torch.tensor(list(self.bias), dtype=torch.long, device=logits.device)
                vals = torch.tensor(list(self.bias.values()), dtype=torch.float32, device=logits.device)
                self._bias_row[ids] = vals
            logits = logits + self._bias_row
        return logits

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` [V]; records its log-probabilities when asked for."""
        return pick_rows([self], logits[None])[0]

    def _entry(self, token: int, logprob: float, top_values: list, top_ids: list) -> dict:
        text, raw = token_text(self.codec, token)
        top = []
        for lp, i in zip(top_values[:self.top], top_ids[:self.top]):
            alt_text, alt_raw = token_text(self.codec, i)
            top.append((i, alt_text, lp, alt_raw))
        return {"id": token, "token": text, "logprob": logprob, "bytes": raw, "top": top}

    def take(self) -> dict:
        """``{"logprobs": entries}`` picked since the last take (``{}`` when none were asked for)."""
        if self.top is None:
            return {}
        out, self.pending = self.pending, []
        return {"logprobs": out}


def pick_rows(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """The next token of every row: row ``r`` of ``logits`` [R, V] through ``samplers[r]`` (each with
    its own penalties, bias, temperature, ``top_p``, generator and log-probabilities). The batch is
    done in tensor ops over [R, V] (one argmax, one softmax of the sampling rows, one log-softmax and
    top-k of the rows asking log-probabilities, one read of the picked ids); what stays per row is
    what only that row has: penalties / bias when set, ``top_p`` and the draw from its own
    generator (so a seed gives the same tokens whatever else is in the batch)."""
    adjusted = logits.float()  # [R, V]
    special = [r for r, s in enumerate(samplers) if s.counts is not None or s.bias]
    if special:
        adjusted = adjusted.clone()
        for r in special:
            adjusted[r] = samplers[r]._adjusted(adjusted[r])
    tokens = torch.argmax(adjusted, dim=-1)  # [R]: the greedy answer, replaced below for the sampling rows
    hot = [r for r, s in enumerate(samplers) if s.temperature != 0]
    if hot:
        temps = torch.tensor([samplers[r].temperature for r in hot], dtype=adjusted.dtype, device=adjusted.device)
        probs = torch.softmax(adjusted[hot] / temps[:, None], dim=-1)  # [R', V]
        finite = torch.isfinite(probs).all(dim=-1).tolist()  # not: so small a temperature that logits / t overflow
        for j, r in enumerate(hot):
            if finite[j]:
                s, p = samplers[r], probs[j]
                if s.top_p < 1.0:
                    p = nucleus(p, s.top_p)
                tokens[r] = torch.multinomial(p, 1, generator=s.generator)[0]
    picked = tokens.tolist()
    entries = {}  # every row's state changes only once all rows are picked (a failed batch changes none)
    asks = [r for r, s in enumerate(samplers) if s.top is not None and picked[r] not in s.codec.eos_ids]
    if asks:
        logprobs = torch.log_softmax(adjusted[asks], dim=-1)  # [R'', V]
        chosen = logprobs.gather(1, torch.tensor([[picked[r]] for r in asks], device=logprobs.device))[:, 0].tolist()
        k = min(max(samplers[r].top for r in asks), logprobs.shape[-1])
        values, ids = torch.topk(logprobs, k) if k else (logprobs[:, :0], logprobs[:, :0].long())  # [R'', k]
        values, ids = values.tolist(), ids.tolist()
        entries = {r: samplers[r]._entry(picked[r], chosen[j], values[j], ids[j]) for j, r in enumerate(asks)}
    for r, s in enumerate(samplers):
        if s.presence or s.frequency:
            if s.counts is None:
                s.counts = torch.zeros_like(adjusted[r])
            s.counts[picked[r]] += 1
        if r in entries:
            s.pending.append(entries[r])
    return picked
