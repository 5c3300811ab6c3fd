"""Continuous batching: a waiting queue, running sequences, and the fixed KV slots they occupy."""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class Scheduler:
    """Sequences join between steps when a KV slot is free and leave as soon as they finish.

    Every slot holds `max_model_len` tokens and requests are validated against that length, so
    an admitted sequence never needs preemption.
    """

    def __init__(self, num_slots: int, max_num_seqs: int):
        self.free_slots: deque[int] = deque(range(num_slots))
        self.max_running = min(num_slots, max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots (FIFO); they need a prefill this step."""
        admitted = []
        while self.waiting and self.free_slots and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def release_finished(self) -> list[Sequence]:
        """Drop finished sequences from the batch and free their slots."""
        done = [s for s in self.running if s.finish_reason is not None]
        if done:
            self.running = [s for s in self.running if s.finish_reason is None]
            for s in done:
                self.free_slots.append(s.slot)
                s.slot = None
        return done

    def abort(self, seq_id: int) -> Sequence | None:
        """Remove a sequence wherever it is (a client went away); returns it if it was still live."""
        for s in self.waiting:
            if s.seq_id == seq_id:
                self.waiting.remove(s)
                return s
        for s in self.running:
            if s.seq_id == seq_id and s.finish_reason is None:
                self.running.remove(s)
                self.free_slots.append(s.slot)
                s.slot = None
                return s
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
