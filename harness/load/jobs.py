"""What goes between a load spread over client processes and each of them (pydantic, JSON lines):
the job a process runs, what it is asked for once stopped, and its report."""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, Field

from .prompts import Lengths, token_prompts
from .request import COMPLETIONS, Request
from .result import GAP_WINDOW_S, RequestResult


class Bodies(BaseModel):
    """These JSON bodies, in order, then the load ends."""

    kind: Literal["bodies"] = "bodies"
    path: str = COMPLETIONS
    stream: bool = True
    bodies: list[str]

    def requests(self) -> Iterator[Request]:
        return (Request(self.path, b.encode(), self.stream) for b in self.bodies)


class TokenPrompts(BaseModel):
    """Streaming completions without end: random token-id prompts (seeded) of `input_len` tokens,
    `output_len` tokens each (N or LO:HI), greedy, EOS ignored."""

    kind: Literal["token_prompts"] = "token_prompts"
    model: str
    vocab: int
    input_len: str
    output_len: str
    seed: int

    def requests(self) -> Iterator[Request]:
        inp, out = Lengths.parse(self.input_len, "input_len"), Lengths.parse(self.output_len, "output_len")
        for ids, max_tokens in token_prompts(random.Random(self.seed), inp, out, self.vocab):
            yield Request.of({"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True, "stream": True})


class Job(BaseModel):
    """One client process: a closed loop of `workers` on `url` over `requests`; it ends when they
    run out, after `duration_s`, or when told to stop."""

    url: str
    timeout_s: float
    workers: int
    duration_s: float | None = None
    requests: Bodies | TokenPrompts = Field(discriminator="kind")


class Collect(BaseModel):
    """What the process sends back once stopped: every result whole, or, with `marks` (times on
    the shared clock), each request reduced to its gaps across them (`within` seconds after each)."""

    marks: list[float] | None = None
    within: float = GAP_WINDOW_S
    until: list[float | None] | None = None  # per mark: the gaps it counts end by then (None: no bound)
    itl_marks: list[int] = Field(default_factory=list)  # marks whose waits between tokens come back whole


class Gaps(BaseModel):
    """A request reduced to what a failover bench needs: the gap it saw across each mark (None: not
    in flight then; `RequestResult.gap_across`) and its longest wait for tokens."""

    sent: float
    end: float
    error: str | None
    across: list[float | None]
    longest: float
    longest_at: float = 0.0  # when the longest wait began
    longest_after: int = 0  # token-bearing events before it (0: the wait for the first)
    first_at: float | None = None  # when its first token came (None: none came)
    between: list[float | None] = Field(default_factory=list)  # per mark: as `across`, waits between tokens only
    itl: list[list[float]] = Field(default_factory=list)  # per `itl_marks` mark: its waits between tokens there

    @classmethod
    def of(cls, r: RequestResult, marks: list[float], within: float = GAP_WINDOW_S,
           until: list[float | None] | None = None, itl_marks: list[int] | None = None) -> "Gaps":
        bounds = until or [None] * len(marks)
        at, after = r.longest_gap_at()
        itl = [[round(w, 6) for w in r.waits_in(marks[i], within, bounds[i], first=False)] for i in itl_marks or []]
        return cls(sent=r.sent, end=r.end or r.sent, error=r.error,
                   across=[r.gap_across(t, within, u) for t, u in zip(marks, bounds)], longest=r.longest_gap(),
                   longest_at=at, longest_after=after, first_at=r.content_times[0] if r.content_times else None,
                   between=[r.gap_across(t, within, u, first=False) for t, u in zip(marks, bounds)], itl=itl)


class ProcessReport(BaseModel):
    """One process's load: when it ran (shared clock), its CPU seconds, and its requests."""

    start: float
    end: float
    cpu_s: float
    results: list[RequestResult] = Field(default_factory=list)
    gaps: list[Gaps] = Field(default_factory=list)
