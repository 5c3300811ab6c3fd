"""Diagnostics of the scheduler step (engines/core/engine.py `LLMEngine.step`), behind one hook: the
step calls its observers at each of POINTS and once when it ended; with none registered (the steady
state) that is a loop over an empty list.

`PromotionTiming` is the one observer today: registered at a promotion, it times each step's phases
(and the thread's CPU time, and the device memory torch held after the launch) for the promotion
trace (engines/core/promotion_trace.py), and leaves once the trace has logged its window."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Protocol

from .promotion_trace import PromotionTrace

if TYPE_CHECKING:
    from .scheduler import Scheduled

# A step's moments: it began, scheduled (the tails' copies made), prepared (the markers out, the inputs
# packed), run (the forward launched), sampled (the draw and its copy launched), built (the Sequences of
# requests that arrived meanwhile made), read back (the previous step's tokens on the host).
POINTS = ("began", "scheduled", "prepared", "run", "sampled", "built", "read_back")


class StepObserver(Protocol):
    def at(self, point: str) -> None:
        """The step reached `point` (one of POINTS, in order)."""

    def ended(self, work: list[Scheduled]) -> bool:
        """The step ended, having run `work`; False: unregister this observer."""


class StepObservers(list):
    """The engine's step hook: observers called in order (`at`, `ended`)."""

    def at(self, point: str) -> None:
        for o in self:
            o.at(point)

    def ended(self, work: list[Scheduled]) -> None:
        if self:
            self[:] = [o for o in self if o.ended(work)]


class PromotionTiming:
    """Each step's moments for `trace` (armed), until it has logged its window."""

    def __init__(self, trace: PromotionTrace, reserved: Callable[[], int | None]) -> None:
        self.trace, self.reserved = trace, reserved
        self._marks: list[float] = []
        self._cpu: list[float] = []
        self._held: int | None = None

    def at(self, point: str) -> None:
        self._marks.append(time.monotonic())
        self._cpu.append(time.thread_time())
        if point == "sampled":  # (what the launch left the allocator holding; read before the build phase)
            self._held = self.reserved()

    def ended(self, work: list[Scheduled]) -> bool:
        marks, cpu, self._marks, self._cpu = self._marks, self._cpu, [], []
        self.trace.step(marks, len(work), sum(w.num_new for w in work), cpu, self._held)
        return self.trace.armed
