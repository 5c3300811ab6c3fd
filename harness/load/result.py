"""One request as the client saw it (pydantic: it also crosses from client processes as JSON), and
the figures taken from its timeline. Times are on the clock the load ran with (time.monotonic unless
said: the system-wide monotonic clock, so the times of several processes compare)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

#: What went wrong: nothing listening, another connect failure, no data within the timeout, the
#: connection broke (closed, reset, not HTTP), a non-200 answer, a body or stream event that is not
#: JSON, an error event in the stream, a stream that ended without finishing (no finish_reason or
#: no `data: [DONE]`), the load stopped while it was in flight.
Failure = Literal["refused", "connect", "timeout", "broken", "http", "bad_body", "bad_event", "error_event", "cut",
                  "cancelled"]


GAP_WINDOW_S = 1.0  # seconds after a kill in which a stream's longest wait for tokens is its gap


class Usage(BaseModel):
    """The server's token counts (the final `usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class RequestResult(BaseModel):
    """What was sent, when each piece of the answer came, how it ended."""

    path: str
    stream: bool
    sent: float  # when the request was sent
    end: float | None = None  # when the answer ended or failed; None while in flight
    head: float | None = None  # when the status line and headers came
    status: int | None = None
    failure: Failure | None = None
    error: str | None = None  # the failure in words; None: a success (once ended)
    engine: str | None = None  # the router's x-understudy-* headers
    epoch: int | None = None
    retries: int | None = None
    response_id: str | None = None
    text: str | None = None  # the generated text, when the client keeps it
    usage: Usage | None = None
    content_times: list[float] = Field(default_factory=list)  # arrival of each event that brings tokens
    event_times: list[float] | None = None  # arrival of every data event ([DONE] too), when kept

    @property
    def ok(self) -> bool:
        return self.end is not None and self.error is None

    @property
    def latency(self) -> float:
        """Seconds from the send to the end of the answer (or of the failure)."""
        return (self.end or self.sent) - self.sent

    @property
    def ttft(self) -> float | None:
        """Seconds from the send to the first event that brought tokens."""
        return self.content_times[0] - self.sent if self.content_times else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive token-bearing events."""
        t = self.content_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def output_tokens(self) -> int:
        """The server's count when it gave one (`usage_reported`), else the token-bearing events."""
        return self.usage.completion_tokens if self.usage else len(self.content_times)

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens if self.usage else 0

    @property
    def usage_reported(self) -> bool:
        return self.usage is not None

    def longest_gap(self) -> float:
        """The longest wait for tokens (from the send for the first)."""
        return longest_wait(self.sent, self.content_times)

    def longest_gap_at(self) -> tuple[float, int]:
        """Where the longest wait began, and how many token-bearing events came before it (0: the
        wait for the first)."""
        times = [self.sent, *self.content_times]
        waits = [b - a for a, b in zip(times, times[1:])]
        i = max(range(len(waits)), key=waits.__getitem__, default=0)
        return times[i], i

    def gap_across(self, t: float, within: float = GAP_WINDOW_S, until: float | None = None,
                   first: bool = True) -> float | None:
        """For a request in flight at `t` (a kill): its longest wait for tokens among the gaps that end
        after `t` (and by `until`, if given: a quiet moment's window stops short of the next kill) and
        begin before `t + within`. (Tokens already on their way at `t` arrive after it: the gap that
        ends at the first of them is not the stall, which comes after them.) None if it was not in
        flight then, or got no tokens in that span. `first=False`: only waits between tokens count
        (not the wait for the first; None for a request that had none in the span)."""
        if not self.sent < t < (self.end or self.sent):
            return None
        waits = self.waits_in(t, within, until, first)
        return max(waits) if waits else None

    def waits_in(self, t: float, within: float = GAP_WINDOW_S, until: float | None = None,
                 first: bool = True) -> list[float]:
        """Its waits for tokens that end after `t` (and by `until`) and begin before `t + within`;
        with `first=False` only those between tokens (a client's inter-token latencies there)."""
        times = [self.sent, *self.content_times] if first else self.content_times
        return [b - a for a, b in zip(times, times[1:]) if b > t and a < t + within and (until is None or b <= until)]


def longest_wait(start: float, times: Sequence[float]) -> float:
    """The longest of the gaps from `start` to the first of `times` and between the next ones."""
    return max((b - a for a, b in zip([start, *times], times)), default=0.0)
