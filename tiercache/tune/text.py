"""The token windows tune and check read: calibration text and verification text never overlap.

Interface
    encode(tokenizer, text) -> [int]           the tiny model's bytes or a tokenizer's ids, no specials
    windows(tokenizer, files, length, count) -> (list of [length] tensors, description)
        ``count`` disjoint windows of ``length`` tokens: from the user's ``files`` (UTF-8, joined
        with a blank line) when given, else from the built-in held-out text (the Python standard
        library's held-out files, ``tiercache.models.corpus``). Window ``0`` is what ``tune``
        calibrates on; the last is what it verifies on. ``TextError`` (a ``ValueError``) when a file
        cannot be read or the text is too short, saying how many tokens it has and how many are needed.
"""

from __future__ import annotations

from pathlib import Path

import torch


class TextError(ValueError):
    """Text that cannot serve: unreadable, or too short for the windows asked for."""


def encode(tokenizer, text: str) -> list[int]:
    from tiercache.models.tiny import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _read(files) -> str:
    parts = []
    for f in files:
        try:
            parts.append(Path(f).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise TextError(f"--text {f!r} cannot be read as UTF-8 text: {e}") from None
    return "\n\n".join(parts)


def windows(tokenizer, files, length: int, count: int) -> tuple[list[torch.Tensor], str]:
    need = length * count
    if files:
        ids = torch.tensor(encode(tokenizer, _read(files)), dtype=torch.long)  # [N]
        source = ", ".join(str(f) for f in files)
    else:
        from tiercache.models import tiny

        try:
            ids = tiny.eval_ids(tokenizer, need)  # [need]
        except tiny.HeldoutTooShort as e:
            raise TextError(f"the built-in held-out text gives {e.available} tokens with this tokenizer; "
                            f"{count} windows of {length} tokens need {need}: lower --context") from None
        source = "built-in held-out text (Python standard library files, tiercache.models.corpus)"
    if ids.numel() < need:
        raise TextError(f"--text has {ids.numel()} tokens with this model's tokenizer; {count} disjoint windows of "
                        f"{length} tokens (calibration apart from verification) need {need}: give more text or "
                        "lower --context")
    step = ids.numel() // count
    return [ids[i * step : i * step + length] for i in range(count)], source
