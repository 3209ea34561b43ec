"""Text every machine has: the Python standard library's source files, as bytes.

Interface
- ``stdlib_files() -> list[Path]``: sorted ``*.py`` files under ``sysconfig.get_paths()['stdlib']``
  (``site-packages`` excluded).
- ``is_heldout(path) -> bool``: the fixed split *by file*: a file is held out when the sha256 of
  its path relative to the stdlib root is 0 mod 20 (about 5 %); stable across machines and
  Python versions because it depends on the name only.
- ``load_split(split) -> torch.Tensor``: ``[N]`` int64 byte ids of the files of ``"train"`` or
  ``"heldout"``, each file followed by ``EOS``.

Token ids: bytes are 0..255; ``BOS = 256``, ``EOS = 257``, ``PAD = 258``; ``VOCAB_SIZE = 259``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259
HELDOUT_MOD = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())


def is_heldout(path: Path) -> bool:
    rel = path.relative_to(stdlib_root()).as_posix()
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def load_split(split: str, max_bytes: int | None = None) -> torch.Tensor:
    """``[N]`` int64 ids of one split's files in sorted order, EOS after each file."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    chunks, total = [], 0
    for path in stdlib_files():
        if is_heldout(path) != (split == "heldout"):
            continue
        data = path.read_bytes() + bytes([0])  # placeholder byte, replaced by EOS below
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    ids = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).to(torch.int64)  # [N]
    ends = torch.tensor([len(c) for c in chunks]).cumsum(0) - 1  # [files]
    ids[ends] = EOS
    return ids[:max_bytes] if max_bytes is not None else ids
