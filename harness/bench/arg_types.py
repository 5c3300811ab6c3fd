"""argparse types for the benches' counts and sizes: a bad value is refused by argparse, naming the
option (usage, exit 2), instead of failing inside the bench."""
from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return x


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. 1,8,32."""
    return [positive_int(part) for part in text.split(",")]
