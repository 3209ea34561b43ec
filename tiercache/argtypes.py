"""argparse types shared by the CLI (``tiercache.cli``) and the bench command (``tiercache.bench.command``):
``positive_int`` (a whole number >= 1), ``non_negative_int`` (>= 0), ``positive_seconds`` (a finite
number of seconds > 0); the message says what was wrong."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
    return n


def positive_seconds(text: str) -> float:
    """argparse type: a duration in seconds, finite and > 0 (``0``, negatives, ``nan`` and ``inf``
    are refused: a zero or negative limit times out every request, NaN never compares)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, a number > 0 such as 600 or 2.5, got {text!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0 (such as 600 or 2.5), got {text!r}")
    return x
