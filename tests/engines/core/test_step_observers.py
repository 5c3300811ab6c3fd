"""The scheduler step's diagnostics behind one hook (engines/core/step_observers.py), on the tiny
checkpoint (fp32, CPU): an observer sees every point of every step in order and its end; the
promotion trace's timing is one such observer, gone once the trace has logged; with none the step
gives the same tokens."""
from __future__ import annotations

import logging

from engines.core import promotion_trace
from engines.core.sampling import SamplingParams
from engines.core.step_observers import POINTS, PromotionTiming
from test_engine_units import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


class Recorder:
    def __init__(self, leave_after: int | None = None) -> None:
        self.points: list[str] = []
        self.ends: list[int] = []
        self.leave_after = leave_after

    def at(self, point: str) -> None:
        self.points.append(point)

    def ended(self, work) -> bool:  # noqa: ANN001
        self.ends.append(len(work))
        return self.leave_after is None or len(self.ends) < self.leave_after


def test_an_observer_sees_every_point_of_every_step_in_order(tiny_model) -> None:
    engine = make_engine(tiny_model, max_num_seqs=2, max_len=64, budget=64)
    plain = engine.generate([[1, 2, 3, 4, 5]], GREEDY)
    seen, brief = Recorder(), Recorder(leave_after=2)
    engine.observers += [seen, brief]
    steps = engine.steps
    assert engine.generate([[1, 2, 3, 4, 5]], GREEDY) == plain  # observed, the same tokens
    n = engine.steps - steps
    assert n >= 2 and seen.points == list(POINTS) * n and len(seen.ends) == n and seen.ends[0] == 1
    assert len(brief.ends) == 2 and brief.points == list(POINTS) * 2 and engine.observers == [seen]


def test_the_promotion_trace_times_steps_until_it_has_logged(tiny_model, monkeypatch, caplog) -> None:
    monkeypatch.setattr(promotion_trace, "WINDOW_S", 0.0)  # (its first step ends the window)
    engine = make_engine(tiny_model, max_num_seqs=2, max_len=64, budget=64)
    engine.trace.arm(None)
    engine.observers.append(PromotionTiming(engine.trace, engine._reserved))
    with caplog.at_level(logging.INFO, "engines.core.promotion_trace"):
        engine.generate([[1, 2, 3]], GREEDY)
    (line,) = [r.getMessage() for r in caplog.records if "after the promotion" in r.getMessage()]
    assert "1 steps" in line and "schedule/prepare/run/sample/build/wait/seal ms" in line and "; CPU " in line
    assert engine.observers == [] and not engine.trace.armed
