"""Token-budget scheduling: each step spends one budget on the decode rows of every running
sequence, then on prefill chunks of waiting ones (a long prompt spans several steps).

While any decode row is in a step, the prefill chunks beside it add at most `prefill_cap` tokens
(a failover's continuations aside: their clients are mid-answer), so a mixed step stays near a
decode step and a running stream's wait for its next token is bounded (issue 56); a step with no
decode row spends the whole budget.

Sequences wait in a fair queue: one request with many prompts (or a large `n`) is admitted one
sequence per turn, alternating with every other request, so it cannot starve them. When blocks run
out, a running sequence that cannot grow makes the newest running sequence give its blocks back
(preemption): it returns to the front of the queue and is recomputed later. A client never sees
an error or a truncation for it, only a later token.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from itertools import islice

from .block_manager import BlockManager
from .sequence import Sequence


@dataclass
class Scheduled:
    """`num_new` positions of `seq` starting at `start` are computed this step."""

    seq: Sequence
    start: int
    num_new: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's end, so its last row's logits pick the next token."""
        return self.start + self.num_new == self.seq.total_len


class FairQueue:
    """Waiting sequences, taken round-robin across requests (FIFO inside a request); before them the
    preempted ones, then continued ones (a stream another engine began: its client is waiting
    mid-answer, so it never queues behind a request that arrived during the failover). One request
    (a failover's batch is one) has at most `ahead` continued sequences waiting ahead of the others at
    a time, the engine's slots: a failover's continuations all fit, a flood of continuations from
    inside the node takes its turns with everyone (issue 52)."""

    def __init__(self, ahead: int) -> None:
        self._groups: OrderedDict[int, deque[Sequence]] = OrderedDict()
        self._front: deque[Sequence] = deque()  # preempted: served before anyone else
        self._continued: deque[Sequence] = deque()  # then continuations, in arrival order
        self._ahead, self._ahead_by_group = ahead, Counter()  # (what each request has in `_continued`)

    def __len__(self) -> int:
        return len(self._front) + len(self._continued) + sum(len(q) for q in self._groups.values())

    def __iter__(self):
        yield from self._front
        yield from self._continued
        for q in self._groups.values():
            yield from q

    def push(self, seq: Sequence) -> None:
        if seq.replayed and self._ahead_by_group[seq.group] < self._ahead:
            self._ahead_by_group[seq.group] += 1
            self._continued.append(seq)
        else:
            self._groups.setdefault(seq.group, deque()).append(seq)

    def continuations(self, limit: int) -> list[Sequence]:
        """The first `limit` continued sequences waiting (in the order they are taken)."""
        return list(islice(self._continued, limit))

    def queue_of(self, seq: Sequence) -> str:
        """Which queue holds `seq`: preempted, continued or new (a request's own, round-robin)."""
        return "preempted" if seq in self._front else "continued" if seq in self._continued else "new"

    def push_front(self, seq: Sequence) -> None:
        self._front.appendleft(seq)

    def peek(self) -> Sequence | None:
        if self._front:
            return self._front[0]
        if self._continued:
            return self._continued[0]
        for q in self._groups.values():
            return q[0]
        return None

    def pop(self) -> Sequence:
        """Take the head; its request then goes to the back of the turn order."""
        if self._front:
            return self._front.popleft()
        if self._continued:
            return self._left_continued(self._continued.popleft())
        group, q = next(iter(self._groups.items()))
        seq = q.popleft()
        del self._groups[group]
        if q:
            self._groups[group] = q
        return seq

    def remove(self, seq: Sequence) -> bool:
        if seq in self._front:
            self._front.remove(seq)
            return True
        if seq in self._continued:
            self._continued.remove(seq)
            self._left_continued(seq)
            return True
        q = self._groups.get(seq.group)
        if q is None or seq not in q:
            return False
        q.remove(seq)
        if not q:
            del self._groups[seq.group]
        return True

    def _left_continued(self, seq: Sequence) -> Sequence:
        self._ahead_by_group[seq.group] -= 1
        if not self._ahead_by_group[seq.group]:
            del self._ahead_by_group[seq.group]
        return seq


class _PrefillCap:
    """The prefill tokens a step has left beside its decode rows. A continuation (a stream another
    engine began: its client is mid-answer, and it recomputes at most a block) is never held back."""

    def __init__(self, tokens: int) -> None:
        self.left = tokens

    def allow(self, seq: Sequence, n: int) -> int:
        return n if seq.replayed else min(n, self.left)

    def spend(self, seq: Sequence, n: int) -> None:
        if not seq.replayed:
            self.left = max(0, self.left - n)


class Scheduler:
    """Decides, step by step, which positions of which sequences to compute."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_cap: int | None = None):
        self.blocks = blocks
        self.max_running = max_num_seqs
        self.budget = max_num_batched_tokens
        self.prefill_cap = prefill_cap  # prefill tokens beside decode rows per step (None: the budget)
        self.waiting = FairQueue(max_num_seqs)
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.push(seq)

    def schedule(self) -> list[Scheduled]:
        """The work of one step. Sequences with nothing to compute (finished, or waiting for their
        unread token to tell) are skipped."""
        budget, out = self.budget, []
        scheduled: set[Sequence] = set()
        decodes = [s for s in self.running if s.total_len - s.num_computed == 1]
        chunks = [s for s in self.running if s.total_len - s.num_computed > 1]
        cap = _PrefillCap(self.prefill_cap if decodes and self.prefill_cap is not None else budget)
        for seq in decodes + chunks:  # decode rows first: a long prompt never delays them
            if budget == 0:
                break
            need = seq.total_len - seq.num_computed
            if not seq.block_table or seq.finish_reason is not None or (need == 1 and not seq.can_grow):
                continue  # preempted this step (no blocks), finished, or waiting for its unread token
            n = min(need, budget) if need == 1 else cap.allow(seq, min(need, budget))
            if n == 0:
                continue  # the step's prefill tokens are spent: its chunk waits for the next step
            if not self._make_room(seq, seq.num_computed + n, scheduled):
                continue  # seq itself was preempted
            out.append(self._take(seq, n))
            scheduled.add(seq)
            budget -= n
            if need > 1:
                cap.spend(seq, n)
        preempted = self.preemptions
        room = self.max_running - len(self.running)
        if budget and room > 1:  # (a failover's continuations: their prefixes found at once)
            self.blocks.match_many([s for s in self.waiting.continuations(room) if not s.block_table])
        while budget and len(self.running) < self.max_running and self.waiting.peek() is not None:
            seq = self.waiting.peek()
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            n = cap.allow(seq, min(seq.total_len - seq.num_computed, budget))
            if n == 0 or self.preemptions != preempted or not self.blocks.can_grow(seq, seq.num_computed + n):
                break  # no room (or no prefill tokens left this step): it waits (its cached prefix stays referenced)
            self.waiting.pop()
            self.running.append(seq)
            out.append(self._take(seq, n))
            budget -= n
            cap.spend(seq, n)
        return out

    def _take(self, seq: Sequence, n: int) -> Scheduled:
        if seq.first_scheduled is None:
            seq.scheduled()  # its marker goes out before the step runs (LLMEngine.step)
        start = seq.num_computed
        self.blocks.grow(seq, start + n)
        seq.num_computed = start + n
        return Scheduled(seq, start, n)

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[Sequence]) -> bool:
        """Preempt the newest running sequences not scheduled yet this step until `seq` can hold
        `num_tokens`; False if that meant preempting `seq` itself."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = next(s for s in reversed(self.running) if s not in scheduled)  # seq itself at the latest
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Give the sequence's blocks back; it waits at the front and recomputes its tokens later."""
        self.running.remove(seq)
        self.blocks.release(seq)
        self.waiting.push_front(seq)
        self.preemptions += 1

    def release_finished(self) -> list[Sequence]:
        """Drop finished sequences (running, or preempted and waiting) and free their blocks."""
        done = [s for s in self.running if s.finish_reason is not None]
        if done:
            self.running = [s for s in self.running if s.finish_reason is None]
        done += [s for s in list(self.waiting) if s.finish_reason is not None and self.waiting.remove(s)]
        for s in done:
            self.blocks.release(s)
        return done

    def abort(self, seq_id: int) -> Sequence | None:
        """Remove a sequence wherever it is (a client went away); returns it if it was still live."""
        for s in list(self.waiting):
            if s.seq_id == seq_id:
                self.waiting.remove(s)
                self.blocks.release(s)
                return s
        for s in self.running:
            if s.seq_id == seq_id and s.finish_reason is None:
                self.running.remove(s)
                self.blocks.release(s)
                return s
        return None

    def take_all(self) -> list[Sequence]:
        """Remove every sequence, running or waiting, freeing their blocks (a handoff)."""
        seqs = self.running + list(self.waiting)
        self.running, self.waiting = [], FairQueue(self.max_running)
        for s in seqs:
            self.blocks.release(s, handed_off=True)
        return seqs

    @property
    def has_work(self) -> bool:
        return bool(len(self.waiting) or self.running)
