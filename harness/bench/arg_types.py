"""argparse types for the benches' counts and sizes: a bad value is refused by argparse, naming the
option (usage, exit 2), instead of failing inside the bench."""
from __future__ import annotations

import argparse
import math

from supervisor.arg_types import bounded_int


positive_int = bounded_int(1, None, "an integer >= 1")


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
