"""Byte counts as people read and write them.

Interface
    human(n) -> str          bytes as B / KiB / MiB / GiB / TiB, one decimal (binary units: 1 GiB = 2^30)
    card_text(n) -> str      a card's memory: ``24 GB (22.35 GiB)`` when a whole number of GB, else GiB
    card_size(text) -> int   argparse type of ``--gpu-memory``: a GPU's memory with its unit

Units: ``GB`` / ``MB`` / ``TB`` are decimal (10^9 ...: how cards are sold, a "24 GB" card holds
24e9 bytes = 22.35 GiB), ``GiB`` / ``MiB`` / ``TiB`` binary (2^30 ...: what ``human`` prints and
what ``torch.cuda.mem_get_info`` reports divided by 2^30). The parser is the policy's
(``tiercache.policy.fields.parse_size``), so ``--gpu-memory`` and ``budget.gpu_memory`` read alike.
"""

from __future__ import annotations

import argparse

CARD_FORMS = "24GB (10^9 bytes, as cards are sold), 22.35GiB (2^30 bytes), or bytes with their unit, 24000000000B"


def human(n: int) -> str:
    """Bytes as B / KiB / MiB / GiB / TiB with one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def card_text(n: int) -> str:
    """A card's memory: ``24 GB (22.35 GiB)`` for a whole number of GB, else ``22.35 GiB``."""
    gib = f"{n / 2**30:.2f} GiB"
    return f"{n // 10**9} GB ({gib})" if n % 10**9 == 0 else gib


def card_size(text: str) -> int:
    """argparse type: a GPU's memory, a positive size with its unit (``24GB``, ``22.35GiB``). A bare
    number is refused: ``24`` would be 24 bytes, never a card."""
    from tiercache.errors import PolicyError
    from tiercache.policy.fields import parse_size

    from tiercache.policy.schema import MIN_CARD

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a GPU's memory is positive, got {text!r}; allowed: {CARD_FORMS}")
    if text.strip().lstrip("+").replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} has no unit; allowed: {CARD_FORMS}")
    try:
        n = int(parse_size(text, "--gpu-memory"))
    except PolicyError:
        raise argparse.ArgumentTypeError(f"expected a GPU's memory, got {text!r}; allowed: {CARD_FORMS}") from None
    if n < MIN_CARD:
        raise argparse.ArgumentTypeError(f"{text!r} is {n} bytes, no GPU's memory; allowed: {CARD_FORMS}")
    return n
