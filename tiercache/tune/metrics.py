"""Quality of a cache against full precision: KLD, perplexity change, top-1 agreement, pass-key retrieval.

Interface
    log_probs(logits) -> [M, V]                      float32 log-softmax
    kld(ref_logp, logp) -> [M]                       KL(P_fp || Q) per position, in nats (llama.cpp's
                                                     ``--kl-divergence``: the reference distribution first)
    Figures                                          one policy's measurements (``.row()`` for tables):
        kld (mean over positions), kld_p99, ppl, ppl_ref, ppl_change (relative: ppl / ppl_ref - 1),
        top1 (agreement of argmaxes with full precision), passkey / passkey_ref (found, asked)
    figures(ref_logp, logp, targets, passkey, passkey_ref) -> Figures
    passkey_samples(tokenizer, filler, context, depths=DEPTHS, seed=0) -> [(ids [context], key)]
        a 5-digit key in a line of Python (``PASS_KEY = 48213``) placed at each depth of
        ``filler`` (token ids), the question ``assert PASS_KEY ==`` at the end; code, so that the
        built-in byte-level model (trained on Python) and a real model read it alike
    passkey_found(model, tokenizer, cache, ids, key) -> bool
        prefill ``ids`` through ``cache`` (chunks of ``PREFILL_CHUNK``), decode greedily; found when
        the answer's first digits are the key (decoding stops at the first token that cannot lead there)

``kld``, perplexity and agreement are ``tiercache.bench.quality``'s (``kld``, ``perplexity``,
``agreement``), so ``tiercache bench`` and ``tune`` report one measure.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tiercache.bench import quality
from tiercache.bench.quality import kld
from tiercache.cache.compat import cache_arg
from tiercache.tune.text import encode

DEPTHS = (0.1, 0.5, 0.9)
PREFILL_CHUNK = 512
ANSWER_TOKENS = 8


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), dim=-1)  # [M, V]


@dataclass
class Figures:
    kld: float
    kld_p99: float
    ppl: float
    ppl_ref: float
    ppl_change: float
    top1: float
    passkey: tuple[int, int] | None = None
    passkey_ref: tuple[int, int] | None = None

    def row(self) -> dict:
        return asdict(self)

    def passkey_text(self) -> str:
        if self.passkey is None:
            if self.passkey_ref is not None:  # full precision found none: nothing to lose, not probed
                return f"- (fp {self.passkey_ref[0]}/{self.passkey_ref[1]})"
            return "-"
        return f"{self.passkey[0]}/{self.passkey[1]} (fp {self.passkey_ref[0]}/{self.passkey_ref[1]})"


def figures(ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor, passkey=None, passkey_ref=None) -> Figures:
    per = kld(ref_logp, logp)  # [M]
    nll = -logp.gather(-1, targets[:, None])[:, 0]  # [M]
    nll_ref = -ref_logp.gather(-1, targets[:, None])[:, 0]  # [M]
    ppl, ppl_ref = quality.perplexity(nll), quality.perplexity(nll_ref)
    return Figures(kld=float(per.mean()), kld_p99=float(per.quantile(0.99)), ppl=ppl, ppl_ref=ppl_ref,
                   ppl_change=ppl / ppl_ref - 1.0, top1=quality.agreement(logp.argmax(-1), ref_logp.argmax(-1)),
                   passkey=passkey, passkey_ref=passkey_ref)


def passkey_samples(tokenizer, filler: torch.Tensor, context: int, depths=DEPTHS, seed: int = 0):
    rng = random.Random(seed)
    question = encode(tokenizer, "\nassert PASS_KEY == ")
    out = []
    for depth in depths:
        key = str(rng.randrange(10000, 100000))
        needle = encode(tokenizer, f"\nPASS_KEY = {key}  # the pass key: remember it\n")
        room = context - len(needle) - len(question)
        if room < 16:
            raise ValueError(f"pass key: context {context} is too short for the needle and the question")
        at = int(room * depth)
        body = filler[:room].tolist()
        ids = torch.tensor(body[:at] + needle + body[at:] + question, dtype=torch.long)  # [context]
        out.append((ids, key))
    return out


@torch.no_grad()
def passkey_found(model, tokenizer, cache, ids: torch.Tensor, key: str) -> bool:
    x = ids.to(model.device)[None]  # [1, T]
    for s in range(0, x.shape[1], PREFILL_CHUNK):
        logits = model(input_ids=x[:, s : s + PREFILL_CHUNK], **cache_arg(cache), use_cache=True).logits[:, -1]
    answer = []
    for _ in range(ANSWER_TOKENS):
        nxt = logits.argmax(-1, keepdim=True)  # [1, 1]
        answer.append(int(nxt))
        text = tokenizer.decode(answer).lstrip()
        digits = _digits(text)
        if not key.startswith(digits) or len(digits) < len(text):
            break  # decided: the digits ended, or can no longer be the key
        logits = model(input_ids=nxt, **cache_arg(cache), use_cache=True).logits[:, -1]
    return _digits(tokenizer.decode(answer).strip()) == key


def _digits(text: str) -> str:
    out = ""
    for ch in text:
        if not ch.isdigit():
            break
        out += ch
    return out
