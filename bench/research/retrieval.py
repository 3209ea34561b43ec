"""Long-context retrieval: a pass key (or a key-value pair) hidden at a chosen depth of a long filler text.

Interface
- ``FORMATS``: name -> ``Format`` (``"passkey"``: Mohtashami & Jaggi's needle "The pass key is
  12345. Remember it. 12345 is the pass key." in "The grass is green. ..." filler, asked "What
  is the pass key? The pass key is"; ``"kv"``: a named pair 'The value of the key "apple" is
  12345.', asked for that name's value).
- ``samples(tokenizer, contexts, depths, seed=0, fmt="passkey", chat=False) -> list[Sample]``: one
  sample per (context length, depth): ``context`` ``[T]`` ids (the instruction, filler, the
  needle at ``depth`` of the filler, more filler), ``question`` ``[Q]`` ids (the question, and
  the start of the answer), the ``key`` (5 digits), ``target`` (the length asked). Each
  sample's key (and name) is drawn from ``(seed, length, depth)`` alone, so a run split by length
  asks the same samples.
- ``spread(count) -> list[float]``: ``count`` depths evenly from 0.1 to 0.9 (0.5 for one).
- ``answer(model, cache, sample, tokenizer, max_new=8) -> str``: with ``cache`` already holding the context
  (``research.seeded.seed``), feeds the question as one update, then decodes greedily, up
  to ``max_new`` tokens, stopping once the answer's first number has ended (a later token could
  not change the verdict; on a CPU each step of each setup costs).
- ``extract(text) -> str``: the first number in the answer (digits, spaces between them
  ignored); ``found(text, key) -> bool``: that number is the key.

The context goes into the cache first and the question after it, in a separate update, so the
answer reads the context as the cache keeps it (quantized, with sinks ...): a quantized cache
that packs a prompt still attends to it exactly while it is being packed, so a question inside
the prompt would not test the cache at all.

Why plain text by default, not the chat template: SmolLM2-135M-Instruct, at full precision,
answers the chat form (the question ending the user turn, the assistant's turn opened with "The
pass key is") from its own prior ("... is a magical key that allows you to ...") at ~4k tokens,
while the same model completes the plain form "What is the pass key? The pass key is" with the
key (README: the retrieval table). ``chat=True`` keeps the chat form for models that follow it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from research.texts import decode, encode
from tiercache.cache.compat import cache_arg

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NAMES = ("apple", "river", "violin", "candle", "harbor", "falcon", "meadow", "copper", "lantern", "orchid")
MARK = "\x00HAYSTACK\x00"


@dataclass(frozen=True)
class Format:
    needle: str  # {key}, {name}
    question: str  # {name}
    answer: str  # {name}: the start of the answer, the key comes next


FORMATS = {
    "passkey": Format(" The pass key is {key}. Remember it. {key} is the pass key.", "\nWhat is the pass key?",
                      "The pass key is"),
    "kv": Format(' The value of the key "{name}" is {key}. Remember it: {name} = {key}.',
                 '\nWhat is the value of the key "{name}"?', 'The value of the key "{name}" is'),
}


@dataclass
class Sample:
    context: torch.Tensor  # [T]
    question: torch.Tensor  # [Q]
    key: str
    length: int  # tokens of context + question
    depth: float  # where the needle sits in the filler, 0 (start) .. 1 (end)
    needle: slice  # the needle's token positions in ``context``
    name: str = ""  # the key-value format's key name
    target: int = 0  # the context length asked (``length`` is at most this)


def spread(count: int) -> list[float]:
    if count < 1:
        raise ValueError(f"sample count must be at least 1, got {count}")
    if count == 1:
        return [0.5]
    return [round(0.1 + 0.8 * i / (count - 1), 4) for i in range(count)]


def _frame(tokenizer, chat: bool) -> tuple[str, str]:
    """Text before and after the user's message (with the assistant's turn opened), or plain text."""
    if not chat or getattr(tokenizer, "chat_template", None) is None:
        return "", " "
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = text.split(MARK)
    return before, after


def samples(tokenizer, contexts, depths, seed: int = 0, fmt: str = "passkey", chat: bool = False) -> list[Sample]:
    if fmt not in FORMATS:
        raise ValueError(f"retrieval format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    form = FORMATS[fmt]
    before, after = _frame(tokenizer, chat)
    head = encode(tokenizer, before + INTRO)
    unit = encode(tokenizer, FILLER)
    out = []
    for length in contexts:
        for depth in depths:
            if not 0 <= depth <= 1:
                raise ValueError(f"depth must be in [0, 1], got {depth}")
            rng = random.Random(f"{seed}/{length}/{depth}")
            key, name = str(rng.randint(10000, 99999)), rng.choice(NAMES)
            needle = encode(tokenizer, form.needle.format(key=key, name=name))
            question = torch.tensor(encode(tokenizer, form.question.format(name=name) + after
                                           + form.answer.format(name=name)))
            room = length - len(head) - len(needle) - len(question)
            if room < len(unit):
                raise ValueError(f"context length {length} is too short for the retrieval task (needs > "
                                 f"{len(head) + len(needle) + len(question) + len(unit)} tokens)")
            units = room // len(unit)
            first = round(units * depth)
            at = len(head) + len(unit) * first
            ids = head + unit * first + needle + unit * (units - first)
            out.append(Sample(torch.tensor(ids), question, key, len(ids) + len(question), depth,
                              slice(at, at + len(needle)), name, length))
    return out


@torch.no_grad()
def answer(model, cache, sample: Sample, tokenizer, max_new: int = 8) -> str:
    x = sample.question.to(model.device)[None]  # [1, Q]
    logits = model(input_ids=x, **cache_arg(cache), use_cache=True).logits[:, -1]  # [1, V]
    out = []
    for step in range(max_new):
        nxt = logits.argmax(-1, keepdim=True)  # [1, 1]
        out.append(int(nxt))
        if step + 1 == max_new or _settled(decode(tokenizer, out)):
            break
        logits = model(input_ids=nxt, **cache_arg(cache), use_cache=True).logits[:, -1]
    return decode(tokenizer, out)


def _settled(text: str) -> bool:
    """The answer's first number has ended: more tokens cannot change ``extract``."""
    return re.search(r"\d(?:\s*\d)*\s*[^\d\s]", text) is not None


def extract(text: str) -> str:
    m = re.search(r"\d(?:\s*\d)*", text)
    return re.sub(r"\s", "", m.group()) if m else ""


def found(text: str, key: str) -> bool:
    return extract(text) == key
