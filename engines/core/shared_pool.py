"""An engine over its ranks' shared KV pools (DESIGN.md §2 "The KV pool"): attached at startup
(engines/process/pool_attach.py), it holds one of two roles. Parked (a standby): the pool mapped, graphs captured over it, only its slot's
scratch blocks used. Writer (the primary): the shared blocks, mirrored in the index of rank 0's pool.

`promote` and `demote` run on rank 0's scheduler thread between steps, when the supervisor says so
(control commands `promote`, `demote`, `fenced`): promotion is a role change, not an allocation. A
promotion answers once the role is taken (`take`) and reads the pool after (`adopt`), on the same
thread before its next step: the node's routing change and the continuations' way to this engine
overlap the read of the index (issue 56)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from daemon.kv_attach import KVPoolMapping

from .block_manager import BlockManager
from engines.kv.publish import Publisher

log = logging.getLogger("engines.core.shared_pool")


@dataclass
class SharedPool:
    """Rank 0's pool: what the scheduler's block manager runs on, and the index's writer role."""

    mapping: KVPoolMapping
    slot: int
    tails: bool = False  # as the writer, name the sequences' tails each step (engines/core/tail_publisher.py)

    def __post_init__(self) -> None:
        found = self.mapping.index.peek(self.mapping.layout, self.mapping.fingerprint)  # (warms numpy up too)
        log.info("KV pool %s: %s", self.mapping.pool_id[:8], found if isinstance(found, str) else
                 f"{len(found.sealed)} keyed blocks, {len(found.free)} free")

    def rehearse(self) -> None:
        """Read the index as a promotion would (no claim; what it finds is dropped)."""
        self.mapping.index.peek(self.mapping.layout, self.mapping.fingerprint)

    def block_manager(self, prefix_caching: bool) -> BlockManager:
        """A parked block manager: this slot's scratch blocks until promoted."""
        layout = self.mapping.layout
        return BlockManager(layout.num_blocks, layout.block_size, prefix_caching, scratch=layout.scratch(self.slot),
                            shared=layout.shared_blocks)

    def promote(self, blocks: BlockManager, device: torch.device) -> dict:
        """Take the writer role and adopt what the pool holds (`take`, then `adopt`); the report of both.
        Raises PreviousWriterAlive if the last writer was not fenced."""
        return self.adopt(blocks, device, self.take())

    def take(self) -> dict:
        """The writer role alone (the index's epoch is ours; nothing read yet): what a promotion must
        do before the node routes to us. Raises PreviousWriterAlive if the last writer was not fenced."""
        t0 = time.perf_counter()
        taken = self.mapping.index.take(self.mapping.layout, self.mapping.fingerprint)
        return {"pool_epoch": taken.epoch, "claim_wait_seconds": taken.waited_s, "taken": taken,
                "seconds": time.perf_counter() - t0}

    def adopt(self, blocks: BlockManager, device: torch.device, taken: dict) -> dict:
        """After `take`: read the pool's index and adopt what it holds (before the next step: the
        router's continuations wait in the inbox meanwhile); the adoption's report."""
        t0 = time.perf_counter()
        index = self.mapping.index
        adoption = index.adopt(self.mapping.layout, self.mapping.fingerprint, taken["taken"])
        claimed = time.perf_counter()
        if adoption.reset_reason:
            log.error("KV index rejected (%s): the pool starts empty; nothing it held is served",
                      adoption.reset_reason)
        blocks.become_writer(adoption, index, Publisher(index, blocks.gens, device, blocks.integrity))
        return {"pool_epoch": index.epoch, "adopted_blocks": len(adoption.sealed), "free_blocks": len(adoption.free),
                "quarantined_blocks": len(adoption.quarantined), "tails": len(adoption.tails.blocks),
                "index_reset": adoption.reset_reason, "take_seconds": taken["seconds"],
                "claim_seconds": claimed - t0, "claim_wait_seconds": adoption.waited_s,
                "claim_sort_seconds": adoption.sort_s, "claim_sort_cpu_seconds": adoption.sort_cpu_s,
                "claim_sort_faults": adoption.sort_faults,
                "seconds": taken["seconds"] + time.perf_counter() - t0}

    def demote(self, blocks: BlockManager) -> None:
        """Give the writer role up (every step completed, every shared block released)."""
        blocks.publisher.flush()
        self.mapping.index.release()
        blocks.park()
