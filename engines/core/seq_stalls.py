"""The core's side of the stall logs (wire/stream_timing.py): every STALL_LOG_S, a sequence that the
scheduler has not moved since the last look (its computed positions unchanged) while the engine
stepped is logged with where it was: running (what it waits for) or waiting (in which queue, with the
room the scheduler had). Only sequences whose client has tokens already count: a new request queued
behind others waits for its first token, which is not a stall. Costs the steps nothing: the look
reads the sequences' positions twice a second."""
from __future__ import annotations

import logging
import time

from .block_manager import BlockManager
from .scheduler import Scheduler
from .sequence import Sequence
from wire.stream_timing import STALL_LOG_S

log = logging.getLogger("engines.core.engine")
SHOWN = 4  # sequences described per line


class SequenceStalls:
    """`look(now, steps)` from the scheduler loop (its tick's clock, its step count): logs the sequences
    stalled since the last look, `every_s` at most."""

    def __init__(self, scheduler: Scheduler, blocks: BlockManager, every_s: float = STALL_LOG_S) -> None:
        self.scheduler, self.blocks, self.every_s = scheduler, blocks, every_s
        self._at, self._steps = time.monotonic(), 0
        self._computed: dict[int, int] = {}  # seq_id -> num_computed at the last look

    def look(self, now: float, steps: int) -> None:
        if now - self._at < self.every_s:
            return
        s = self.scheduler
        seqs = [q for q in (*s.running, *s.waiting) if q.output_ids or q.replayed]  # (their clients have tokens)
        if steps - self._steps >= 2:  # (the engine stepped: a sequence left out is a stall of its own)
            stalled = [q for q in seqs if self._computed.get(q.seq_id) == q.num_computed]
            if stalled:
                log.warning("%d sequences not stepped for %.0f ms while %d steps ran (%d of max_num_seqs %d "
                            "running, %d blocks available): %s", len(stalled), (now - self._at) * 1e3,
                            steps - self._steps, len(s.running), s.max_running, self.blocks.available,
                            "; ".join(self._where(q) for q in stalled[:SHOWN]))
        self._at, self._steps = now, steps
        self._computed = {q.seq_id: q.num_computed for q in seqs}

    def _where(self, seq: Sequence) -> str:
        head = f"seq {seq.seq_id} ({len(seq.output_ids)} tokens, {seq.replayed} replayed)"
        if seq in self.scheduler.running:
            return (f"{head} running: {seq.total_len - seq.num_computed} positions to compute, "
                    f"{len(seq.block_table)} blocks, {seq.unread} unread, finish {seq.finish_reason}")
        return f"{head} waiting, {self.scheduler.waiting.queue_of(seq)}"

