"""Prompts as token ids of exact lengths (random ids in [10, vocab), seeded), so no tokenizer is
needed and the endpoint sees exactly the sizes asked for."""
from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

FIRST_ID = 10  # ids below this are often special tokens


@dataclass(frozen=True)
class Lengths:
    """A token count: fixed (lo == hi) or uniform in [lo, hi]."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, what: str) -> "Lengths":
        """'128' or '100:1024' (uniform, both ends included)."""
        try:
            lo, _, hi = text.partition(":")
            out = cls(int(lo), int(hi or lo))
        except ValueError:
            raise ValueError(f"{what}: expected N or LO:HI (token counts), got {text!r}") from None
        if out.lo < 1 or out.hi < out.lo:
            raise ValueError(f"{what}: expected 1 <= LO <= HI, got {text!r}")
        return out

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def token_prompts(rng: random.Random, input_len: Lengths, output_len: Lengths, vocab: int,
                  prefix: Sequence[int] = ()) -> Iterator[tuple[list[int], int]]:
    """Endless (prompt ids, max_tokens): `prefix` + ids of a length drawn from `input_len`, then an
    output length drawn from `output_len`, each from `rng` in that order."""
    while True:
        ids = [*prefix, *random_ids(rng, input_len.draw(rng), vocab)]
        yield ids, output_len.draw(rng)
