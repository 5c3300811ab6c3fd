"""Workloads: prompts as token ids of exact lengths (random ids in [10, vocab), seeded), so no
tokenizer is needed and the endpoint sees exactly the sizes asked for."""
from __future__ import annotations

import random
from dataclasses import dataclass

SHARED_PREFIX_LEN = 1500
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


@dataclass(frozen=True)
class Workload:
    """What one sweep point sends: prompt and output lengths, an optional shared prefix."""

    name: str
    input_len: Lengths
    output_len: Lengths
    prefix_len: int = 0  # ids every prompt starts with (the same ids for every request)
    concurrency: tuple[int, ...] = (1,)
    all_at_once: bool = False  # one point: every request in flight at once (concurrency = requests)
    default_requests: int | None = None

    @property
    def max_total_len(self) -> int:
        return self.prefix_len + self.input_len.hi + self.output_len.hi

    @property
    def mean_prompt_len(self) -> int:
        return round(self.prefix_len + self.input_len.mean)


WORKLOADS = {
    # chat-like sizes through /v1/completions with token-id prompts
    "chat": Workload("chat", Lengths(64, 512), Lengths(128, 128), concurrency=(1, 8, 32, 64, 128, 256)),
    "nano": Workload("nano", Lengths(100, 1024), Lengths(100, 1024), concurrency=(256,), all_at_once=True,
                     default_requests=256),
    "shared-prefix": Workload("shared-prefix", Lengths(32, 32), Lengths(128, 128), prefix_len=SHARED_PREFIX_LEN,
                              concurrency=(1, 8, 32)),
}


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    max_tokens: int


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def make_requests(w: Workload, n: int, vocab: int, seed: int) -> list[RequestSpec]:
    """`n` requests of workload `w`; the shared prefix depends only on the vocab (not on `seed`),
    so every point of a sweep shares it, while the rest differs per seed."""
    if vocab <= FIRST_ID:
        raise ValueError(f"vocab: expected more than {FIRST_ID} token ids, got {vocab}")
    prefix = random_ids(random.Random(1_500_000 + vocab), w.prefix_len, vocab)
    rng = random.Random(seed)
    return [RequestSpec(prefix + random_ids(rng, w.input_len.draw(rng), vocab), w.output_len.draw(rng))
            for _ in range(n)]
