"""A digest of every sealed block's keys and values, checked before another sequence reuses the block
(docs/DESIGN.md §2 "KV integrity").

The digest is a weighted sum, modulo 2^64, of a block's elements read as integers (every layer's keys
and values on this rank), the weights odd 64-bit constants: any change of one element changes it, and
random noise passes with a chance of 2^-64. It is computed by torch on the pool's device, on a stream
of its own (never behind the step in flight), for many blocks in one call:

- when a block is SEALED (its writing step completed): the writer stores it in the block's index
  entry (`BlockIndex.digested`), so a new writer adopts it with the block;
- when a prefix hit or an adoption is about to reuse blocks whose digests are known: those blocks
  are digested again and compared, one host read per lookup (not one per block). A block that no
  longer matches is dropped from the cache and the index (its sequence recomputes it from there on),
  counted (`mismatches`) and logged by block id.

A block whose digest is not known yet (0: sealed by a step not yet read back, or by an older writer)
is used unchecked. On CUDA the digest of a seal is read back one step later, through a pinned buffer
(`collect`): nothing in the step loop waits for it. Under tensor parallelism only rank 0's shard of a
block is digested."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger("engines.kv.integrity")

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LAYER_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # (odd: a layer's sum times it, plus the next layer's)
_SEED = 0x5EED


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """`n` odd int64 weights, the same in every process (drawn on the CPU from a fixed seed)."""
    g = torch.Generator().manual_seed(_SEED)
    w = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64) * 2 + 1
    return w.to(device)


def block_digests(layers: Sequence[torch.Tensor], blocks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The digest (int64, never 0) of each block in `blocks` (int64, on the layers' device), over
    `layers` (each [2, num_blocks, block_size, heads, dim]). Device ops only."""
    total = torch.zeros(len(blocks), dtype=torch.int64, device=blocks.device)
    for layer in layers:
        x = layer.index_select(1, blocks).transpose(0, 1).reshape(len(blocks), -1)
        bits = x.view(_INT_OF[x.element_size()]).to(torch.int64)
        total = total * _LAYER_MIX + (bits * weights[:bits.shape[1]]).sum(1)
    return torch.where(total == 0, torch.ones_like(total), total)


class KVIntegrity:
    """One engine's digests of the blocks it seals, and the checks of blocks about to be reused
    against what they held when sealed (`expected`: the writer's index's digests, 0 = not known)."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        self.layers, self.device = list(layers), layers[0].device
        per_block = layers[0][:, 0].numel()
        self.weights = _weights(per_block, self.device)
        self.expected: np.ndarray | None = None  # set while this engine is the pool's writer
        self.checked = 0  # blocks checked before reuse
        self.mismatches = 0  # of those, blocks whose bytes changed since they were sealed
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._launched: list[tuple[torch.cuda.Event, list[int], list[int], torch.Tensor]] = []

    def digests(self, blocks: list[int]) -> np.ndarray:
        """The digests of `blocks` now (uint64), read to the host: on CUDA a wait for this call's own
        kernels only (its stream)."""
        if self._stream is None:
            return self._digest(blocks).numpy().view(np.uint64)
        with torch.cuda.stream(self._stream):
            out = self._digest(blocks).cpu()
        return out.numpy().view(np.uint64)

    def sealed(self, blocks: list[int], gens: list[int]) -> list[tuple[int, int, int]]:
        """Digest blocks whose writing step has completed: (block, gen, digest) now on the CPU; on
        CUDA launched, and returned by a later `collect`."""
        if not blocks:
            return []
        if self._stream is None:
            return list(zip(blocks, gens, self.digests(blocks).tolist()))
        with torch.cuda.stream(self._stream):
            host = torch.empty(len(blocks), dtype=torch.int64, pin_memory=True)
            host.copy_(self._digest(blocks), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._launched.append((done, blocks, gens, host))
        return []

    def collect(self) -> list[tuple[int, int, int]]:
        """The digests launched by `sealed` on CUDA whose kernels have completed, oldest first."""
        out = []
        while self._launched and self._launched[0][0].query():
            _, blocks, gens, host = self._launched.pop(0)
            out += zip(blocks, gens, host.numpy().view(np.uint64).tolist())
        return out

    def check(self, blocks: list[int]) -> list[int]:
        """Those of `blocks` (blocks about to be reused) that no longer hold what they held when sealed,
        counted and logged (the caller drops them; their sequences recompute from the first they hold)."""
        ids = np.asarray(blocks)
        expected = self.expected[ids]
        known = ids[expected != 0].tolist()
        if not known:
            return []
        bad = [known[i] for i in np.flatnonzero(self.digests(known) != expected[expected != 0]).tolist()]
        self.checked += len(known)
        if bad:
            self.mismatches += len(bad)
            log.error("KV blocks %s changed since they were sealed (their digests differ): dropped from the cache "
                      "and the index; the sequences holding them recompute from there", bad)
        return bad

    def _digest(self, blocks: list[int]) -> torch.Tensor:
        ids = torch.tensor(blocks, dtype=torch.int64).to(self.device, non_blocking=True)
        return block_digests(self.layers, ids, self.weights)
