"""Index writes that wait for the device: a block is SEALED in the shared pool's index only once the
step that filled it has completed, and FREE only once no step in flight can still write it.

Each launched step names a CUDA event recorded after its kernels (the one its sampled tokens' copy
records: no event of our own); a seal or free asked for meanwhile waits behind the latest one, and is
applied once that step has completed, if the block has not been allocated again since (its generation
is unchanged). The engine says which step it has waited for; only without one is an event queried.
On cpu a step has completed when `run` returns: nothing waits.

With an integrity check (engines/kv/integrity.py), the blocks sealed are digested once their writes
are applied, in one call per publication, and each digest is written beside its block's entry."""
from __future__ import annotations

from collections import deque

import torch

from daemon.kv_index import BlockIndex
from engines.kv.integrity import KVIntegrity


class Publisher:
    """The writer's deferred index writes, in launch order."""

    def __init__(self, index: BlockIndex, gens: list[int], device: torch.device,
                 integrity: KVIntegrity | None = None) -> None:
        self.index, self.gens, self.integrity = index, gens, integrity
        self.cuda = device.type == "cuda"
        self._pending: deque[tuple[torch.cuda.Event, list[tuple]]] = deque()
        self._sealed: list[tuple[int, int]] = []  # (block, gen) sealed since the last digests

    def launched(self, done: torch.cuda.Event | None = None) -> None:
        """A step's kernels were just enqueued, `done` recorded after them (None: record one here):
        what is asked from now on waits for them."""
        if self.cuda:
            if done is None:
                done = torch.cuda.Event()
                done.record()
            self._pending.append((done, []))

    def seal(self, block: int, gen: int, key_lo: int, key_hi: int, stamp: int) -> None:
        self._defer(("seal", block, gen, key_lo, key_hi, stamp))

    def free(self, block: int, gen: int, keep_tail: bool = False) -> None:
        self._defer(("free", block, gen, keep_tail))

    def publish_completed(self, waited: torch.cuda.Event | None = None) -> None:
        """Apply the writes of every step that has completed (oldest first): through the step whose
        event the caller has `waited` for, else those whose events a query finds completed."""
        if waited is not None and any(event is waited for event, _ in self._pending):
            while self._pending:
                event, ops = self._pending.popleft()
                self._apply(ops)
                if event is waited:
                    self._digest()
                    return
        while self._pending and self._pending[0][0].query():
            self._apply(self._pending.popleft()[1])
        self._digest()

    def flush(self) -> None:
        """Wait for every launched step, then apply everything."""
        if self._pending:
            self._pending[-1][0].synchronize()
        while self._pending:
            self._apply(self._pending.popleft()[1])
        self._digest()

    def _digest(self) -> None:
        """Digest the blocks sealed since the last call; store the digests that are ready."""
        if self.integrity is None:
            return
        sealed, self._sealed = self._sealed, []
        done = self.integrity.sealed([b for b, _ in sealed], [g for _, g in sealed]) + self.integrity.collect()
        for block, gen, digest in done:
            if self.gens[block] == gen:  # (not allocated again since)
                self.index.digested(block, digest)

    def _defer(self, op: tuple) -> None:
        if self._pending:
            self._pending[-1][1].append(op)
        else:
            self._apply([op])

    def _apply(self, ops: list[tuple]) -> None:
        for op in ops:
            block, gen = op[1], op[2]
            if self.gens[block] != gen:  # allocated again since: this write is stale
                continue
            if op[0] == "seal":
                self.index.sealed(block, gen, *op[3:])
                if self.integrity is not None:
                    self._sealed.append((block, gen))
            else:
                self.index.freed(block, op[3])
