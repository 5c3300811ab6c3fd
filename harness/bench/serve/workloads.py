"""Workloads: what one sweep point sends, as token-id prompts of exact lengths (harness/load/prompts.py)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import islice

from harness.load.prompts import FIRST_ID, Lengths, random_ids, token_prompts

SHARED_PREFIX_LEN = 1500


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


def make_requests(w: Workload, n: int, vocab: int, seed: int) -> list[RequestSpec]:
    """`n` requests of workload `w`; the shared prefix depends only on the vocab (not on `seed`),
    so every point of a sweep shares it, while the rest differs per seed."""
    if vocab <= FIRST_ID:
        raise ValueError(f"vocab: expected more than {FIRST_ID} token ids, got {vocab}")
    prefix = random_ids(random.Random(1_500_000 + vocab), w.prefix_len, vocab)
    prompts = token_prompts(random.Random(seed), w.input_len, w.output_len, vocab, prefix)
    return [RequestSpec(ids, max_tokens) for ids, max_tokens in islice(prompts, n)]
