"""Real text that every machine has offline, as token ids for a real tokenizer: code and prose.

Interface
- ``code(split) -> str``: the standard library's source files of one split (``corpus``: the fixed
  ``"heldout"`` / ``"train"`` split by file name), concatenated.
- ``prose(split) -> str``: English prose that ships with Python: the docstrings (module, class,
  function) of that split's stdlib files; for ``"heldout"`` preceded by CPython's ``LICENSE.txt``
  (its history and licence text) when present.
- ``encode(tokenizer, text) -> list[int]`` / ``decode(tokenizer, ids) -> str``: no special
  tokens, for a transformers tokenizer or the tiny model's byte tokenizer alike.
- ``token_ids(tokenizer, kind, n, split="heldout") -> torch.Tensor``: ``[n]`` ids of ``kind``
  (``"code"`` | ``"prose"``), no special tokens; ``ValueError`` when the text is too short.

Evaluation reads ``heldout``; anything fitted on text (the per-layer sensitivity that mixed
precision uses) reads ``train``, so no figure is measured on the text it was tuned on.
"""

from __future__ import annotations

import ast

import torch

from tiercache.models.corpus import is_heldout, stdlib_files, stdlib_root

KINDS = ("code", "prose")


def _files(split: str):
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return [p for p in stdlib_files() if is_heldout(p) == (split == "heldout")]


def code(split: str = "heldout", max_chars: int = 400_000) -> str:
    out, size = [], 0
    for p in _files(split):
        text = p.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return "\n".join(out)


def prose(split: str = "heldout", max_chars: int = 200_000) -> str:
    out, size = [], 0
    license_file = stdlib_root() / "LICENSE.txt"
    if split == "heldout" and license_file.is_file():
        out.append(license_file.read_text(encoding="utf-8", errors="replace"))
        size += len(out[0])
    for p in _files(split):
        if size >= max_chars:
            break
        try:
            tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):  # test data files that are not valid Python
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:  # sentences, not one-line labels
                    out.append(doc)
                    size += len(doc)
    return "\n\n".join(out)


def token_ids(tokenizer, kind: str, n: int, split: str = "heldout") -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"text kind must be one of {', '.join(KINDS)}, got {kind!r}")
    text = code(split, max_chars=8 * n + 4096) if kind == "code" else prose(split, max_chars=8 * n + 4096)
    ids = encode(tokenizer, text)
    if len(ids) < n:
        raise ValueError(f"{split} {kind} text gives {len(ids)} tokens, {n} asked")
    return torch.tensor(ids[:n], dtype=torch.long)  # [n]


def encode(tokenizer, text: str) -> list[int]:
    if not callable(tokenizer):  # the byte tokenizer (tiercache.models.tiny.ByteTokenizer)
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode(tokenizer, ids) -> str:
    if not callable(tokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)
