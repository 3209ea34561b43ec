"""Byte counts as people read them: ``human(n) -> str`` (B, KiB, MiB, GiB, TiB, one decimal)."""

from __future__ import annotations


def human(n: int) -> str:
    """Bytes as B / KiB / MiB / GiB / TiB with one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
