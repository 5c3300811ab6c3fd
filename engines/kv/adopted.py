"""The keyed blocks a new writer found in the shared pool, kept as the index's arrays until used, so a
promotion takes milliseconds however many blocks the pool holds (building a dict of 60k keys took
8 ms and an LRU of them 5 ms more, on the failover's critical path).

A block leaves this cache when a sequence matches it (it then is the block manager's like any other
keyed block) or when an allocation evicts it (oldest stamp first: these blocks are older than any the
new writer released itself). Lookups are vectorised: a continuation asks for all its blocks at once."""
from __future__ import annotations

import numpy as np

from daemon.kv_index import Adoption


AGE_CHUNK = 4096  # blocks put in age order at a time: a partial sort each, none at promotion


class AdoptedCache:
    """Adopted, not yet used blocks: found by key (sorted arrays), evicted by age (the next
    AGE_CHUNK oldest, found when needed: sorting all 65k stamps at promotion cost 4 ms on the dev VM)."""

    def __init__(self, adoption: Adoption, num_blocks: int) -> None:
        self._lo, self._hi, self._block = adoption.key_lo, adoption.key_hi, adoption.sealed  # by key_lo
        self._stamps = adoption.stamps
        self._aged = np.zeros(len(self._stamps), dtype=bool)  # put in `_by_age` already
        self._by_age = np.empty(0, dtype=self._block.dtype)  # the next oldest blocks, oldest first
        self._cursor = 0
        self.live = np.zeros(num_blocks, dtype=bool)
        self.live[adoption.sealed] = True
        self.count = len(adoption.sealed)

    def find(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """For each key, its live block or -1 (an adoption's keys are unique: one match at most; of
        keys whose lo halves clash, only the first is found, and a miss is only a recomputation)."""
        if not len(self._lo):
            return np.full(len(lo), -1)
        i = np.minimum(np.searchsorted(self._lo, lo), len(self._lo) - 1)
        blocks = np.where((self._lo[i] == lo) & (self._hi[i] == hi), self._block[i], -1)
        return np.where(self.live[np.maximum(blocks, 0)], blocks, -1)

    def take(self, blocks: np.ndarray) -> None:
        """Sequences matched ``blocks``: they are no longer this cache's."""
        self.count -= int(self.live[blocks].sum())
        self.live[blocks] = False

    def evict(self) -> int | None:
        """The oldest live block (its key is dropped by the caller), or None when none is left."""
        while self._cursor < len(self._by_age) or self._age_next():
            block = int(self._by_age[self._cursor])
            self._cursor += 1
            if self.live[block]:  # (take, for one block: no array on the allocation path)
                self.live[block] = False
                self.count -= 1
                return block
        return None

    def _age_next(self) -> bool:
        """The next AGE_CHUNK oldest blocks into `_by_age` (False: none is left)."""
        left = np.flatnonzero(~self._aged)
        if not len(left) or not self.count:
            return False
        stamps = self._stamps[left]
        if len(left) > AGE_CHUNK:
            part = np.argpartition(stamps, AGE_CHUNK - 1)[:AGE_CHUNK]
            left, stamps = left[part], stamps[part]
        chosen = left[np.argsort(stamps, kind="stable")]
        self._aged[chosen] = True
        self._by_age, self._cursor = self._block[chosen], 0
        return True
