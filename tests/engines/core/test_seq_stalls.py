"""The core's stall line (engines/core/seq_stalls.py), on an in-process engine of the tiny checkpoint: a
continued stream that waits for a slot of max_num_seqs while the engine steps others is logged, with
its queue and the room the scheduler had; sequences that step, and a new request queued for its first
token, are not."""
from __future__ import annotations

import logging
import time

from engines.core.sampling import SamplingParams
from engines.core.seq_stalls import SequenceStalls
from test_engine_units import make_engine

LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
EVERY_S = 0.1  # (the engine's looks are STALL_LOG_S apart: these runs would need seconds)


def run_for(engine, seconds: float) -> None:
    """The scheduler loop's work on this thread: take the inbox, step, look for stalls."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        engine._take_inbox(False)
        if engine.has_work:
            engine.step()
        engine.stalls.look(time.monotonic(), engine.steps)


def stall_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not stepped" in r.getMessage()]


def test_a_continuation_waiting_for_a_slot_is_logged_and_running_ones_are_not(tiny_model, caplog) -> None:
    engine = make_engine(tiny_model, max_num_seqs=2, max_len=1024, budget=512)
    engine.stalls = SequenceStalls(engine.scheduler, engine.blocks, EVERY_S)
    for prompt in ([5, 6, 7], [8, 9, 10]):
        engine.submit(prompt, LONG, lambda out: None)
    run_for(engine, 0.05)  # (both running)
    continued = engine.submit([5, 6, 7, 11, 12, 13], LONG, lambda out: None, replayed=3)
    queued = engine.submit([14, 15], LONG, lambda out: None)  # a new request: its wait is for a first token
    with caplog.at_level(logging.WARNING, logger="engines.core.engine"):
        run_for(engine, 3.5 * EVERY_S)
    lines = stall_lines(caplog)
    assert lines, "no stall line while a continued stream waited for a slot"
    assert all(f"seq {continued} " in line and "waiting, continued" in line for line in lines), lines
    assert all(f"seq {queued} " not in line and "running:" not in line for line in lines), lines
    assert "2 of max_num_seqs 2 running" in lines[0]


def test_an_idle_engine_logs_no_stall(tiny_model, caplog) -> None:
    engine = make_engine(tiny_model, max_num_seqs=2, max_len=1024, budget=512)
    engine.stalls = SequenceStalls(engine.scheduler, engine.blocks, EVERY_S)
    with caplog.at_level(logging.WARNING, logger="engines.core.engine"):
        for _ in range(3):
            engine.stalls.look(time.monotonic(), engine.steps)
            time.sleep(EVERY_S)
    assert not stall_lines(caplog)
