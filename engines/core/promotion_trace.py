"""What a new primary did in the first second after its promotion, as one log line: when the
continued requests arrived, how many steps ran and where each of the first ones spent its time. A
failover's stall, as a client sees it, is the promotion plus this; the line says which part of it
is the engine's."""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

log = logging.getLogger("engines.core.promotion_trace")

WINDOW_S = 1.0
SHOWN_STEPS = 10
# A step's moments (time.monotonic): began, scheduled, prepared (the markers out, the inputs packed),
# run (the forward launched), sampled (the draw and its copy to the host launched), built (the
# Sequences of requests that arrived meanwhile made), read back (the previous step's tokens on the
# host), ended (blocks sealed, outputs out).
PHASES = ("schedule", "prepare", "run", "sample", "build", "wait", "seal")


@dataclass
class _Step:
    marks: list[float]  # began, scheduled, prepared, run, sampled, built, read back, ended
    rows: int
    tokens: int
    cpu: list[float] | None = None  # the scheduler thread's CPU seconds (time.thread_time) at each mark
    reserved: int | None = None  # the bytes torch's allocator held on the device after the launch


@dataclass
class PromotionTrace:
    """Armed at a promotion; `step` and `continued` record until WINDOW_S has passed, then it logs."""

    since: float | None = None
    steps: list[_Step] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # continued requests admitted
    reserved: int | None = None  # the device bytes torch's allocator held at the promotion

    @property
    def armed(self) -> bool:
        return self.since is not None

    def arm(self, reserved: int | None = None) -> None:
        self.since, self.steps, self.arrivals, self.reserved = time.monotonic(), [], [], reserved

    def continued(self) -> None:
        if self.since is not None:
            self.arrivals.append(time.monotonic())

    def step(self, marks: list[float], rows: int, tokens: int, cpu: list[float] | None = None,
             reserved: int | None = None) -> None:
        """A step with `rows` sequences and `tokens` tokens, its moments up to the read back; it ended now.
        ``cpu``: the thread's CPU time (time.thread_time) at each moment and at the end: a phase whose
        CPU time is well below its wall time waited (for the GIL, held by another thread of the core,
        or in a driver call that sleeps). ``reserved``: the device bytes torch's allocator held after
        the launch (a step that grew it asked the driver for memory)."""
        if self.since is None:
            return
        cpu = [*cpu, time.thread_time()] if cpu is not None else None
        self.steps.append(_Step([*marks, time.monotonic()], rows, tokens, cpu, reserved))
        if self.steps[-1].marks[-1] - self.since >= WINDOW_S:
            log.info("%s", self.summary())
            self.since = None

    def summary(self) -> str:
        assert self.since is not None
        since = self.since
        ms = lambda t: (t - since) * 1e3  # noqa: E731
        took = [(s.marks[-1] - s.marks[0]) * 1e3 for s in self.steps]
        longest = max(range(len(took)), key=took.__getitem__)
        arrived = (f"{len(self.arrivals)} continued requests admitted from +{ms(self.arrivals[0]):.1f} to "
                   f"+{ms(self.arrivals[-1]):.1f} ms" if self.arrivals else "no continued request")
        shown, reserved = [], self.reserved
        for i, s in enumerate(self.steps[:SHOWN_STEPS]):
            idle = (s.marks[0] - self.steps[i - 1].marks[-1]) * 1e3 if i else ms(s.marks[0])
            cpu = f"; CPU {_phases(s.cpu)}" if s.cpu is not None else ""
            grew = ""
            if s.reserved is not None and reserved is not None and s.reserved > reserved:
                grew = f"; device memory +{(s.reserved - reserved) / 2**20:.0f} MiB"
            reserved = s.reserved if s.reserved is not None else reserved
            shown.append(f"+{ms(s.marks[0]):.0f}: {s.rows} rows {s.tokens} tokens, {took[i]:.1f} ms "
                         f"({_phases(s.marks)}{cpu}{grew}), {idle:.1f} ms between")
        return (f"after the promotion: {arrived}; {len(self.steps)} steps in {WINDOW_S:g} s, median "
                f"{statistics.median(took):.1f} ms, longest {took[longest]:.1f} ms at "
                f"+{ms(self.steps[longest].marks[0]):.1f} ms; the first steps ({'/'.join(PHASES)} ms; the "
                f"loop's time between steps: the inbox, admissions): " + "; ".join(shown))


def _phases(moments: list[float]) -> str:
    """The ms between consecutive moments, joined by '/'."""
    return "/".join(f"{(b - a) * 1e3:.1f}" for a, b in zip(moments, moments[1:]))
