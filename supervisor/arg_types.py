"""argparse types shared by the CLI and the drivers: a bad value is refused by argparse, naming the
option (usage, exit 2)."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def bounded_int(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """The argparse type of an integer in [low, high] (no upper bound if ``high`` is None), said in
    errors as ``what`` ("expected {what}, got ...")."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
        return n
    return parse
