"""Long-context retrieval: a pass key hidden at a chosen depth of a long filler text.

Interface
- ``samples(tokenizer, contexts, depths, seed=0) -> list[Sample]``: one sample per (context
  length, depth): ``context`` ``[T]`` ids (the instruction, filler, the needle at ``depth`` of the
  filler, more filler), ``question`` ``[Q]`` ids (the question, and the start of the answer), the
  ``key`` (5 digits, drawn from ``seed``). With a chat template the whole is one user turn and
  the assistant's answer starts "The pass key is"; without one, plain text.
- ``answer(model, cache, sample, tokenizer, max_new=8) -> str``: with ``cache`` already holding the context
  (``tiercache.bench.seeded.seed``), feeds the question as one update, then decodes greedily.
- ``found(text, key) -> bool``: the key's digits appear in the answer.

The context goes into the cache first and the question after it, in a separate update, so the
answer reads the context as the cache keeps it (quantized, with sinks ...): a quantized cache
that packs a prompt still attends to it exactly while it is being packed, so a question inside
the prompt would not test the cache at all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tiercache.bench.texts import decode, encode

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key?"
ANSWER = "The pass key is"
MARK = "\x00HAYSTACK\x00"


@dataclass
class Sample:
    context: torch.Tensor  # [T]
    question: torch.Tensor  # [Q]
    key: str
    length: int  # tokens of context + question
    depth: float  # where the needle sits in the filler, 0 (start) .. 1 (end)


def _frame(tokenizer) -> tuple[str, str]:
    """Text before and after the user's message, with the assistant's turn opened."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "", " "
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = text.split(MARK)
    return before, after


def samples(tokenizer, contexts, depths, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    before, after = _frame(tokenizer)
    head = encode(tokenizer, before + INTRO)
    unit = encode(tokenizer, FILLER)
    question = torch.tensor(encode(tokenizer, QUESTION + after + ANSWER))
    out = []
    for length in contexts:
        for depth in depths:
            if not 0 <= depth <= 1:
                raise ValueError(f"depth must be in [0, 1], got {depth}")
            key = str(rng.randint(10000, 99999))
            needle = encode(tokenizer, NEEDLE.format(key=key))
            room = length - len(head) - len(needle) - len(question)
            if room < len(unit):
                raise ValueError(f"context length {length} is too short for the pass-key task (needs > "
                                 f"{len(head) + len(needle) + len(question) + len(unit)} tokens)")
            units = room // len(unit)
            first = round(units * depth)
            ids = head + unit * first + needle + unit * (units - first)
            out.append(Sample(torch.tensor(ids), question, key, len(ids) + len(question), depth))
    return out


@torch.no_grad()
def answer(model, cache, sample: Sample, tokenizer, max_new: int = 8) -> str:
    x = sample.question.to(model.device)[None]  # [1, Q]
    logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1]  # [1, V]
    out = []
    for _ in range(max_new):
        nxt = logits.argmax(-1, keepdim=True)  # [1, 1]
        out.append(int(nxt))
        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    return decode(tokenizer, out)


def found(text: str, key: str) -> bool:
    return key in "".join(ch for ch in text if ch.isdigit() or ch == " ").replace(" ", "")
