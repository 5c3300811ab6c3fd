"""One rank's shared KV pool, owned by its daemon: the memory every engine of the rank uses as its paged
KV cache (a memfd on cpu, one CUDA VMM allocation on cuda, both zeroed), and its block index
(daemon/kv_index.py). Engines map both read-write: the pool outlives any engine, so a promoted
standby continues every stream from the blocks the dead primary filled, and the prefix cache
survives engine restarts."""
from __future__ import annotations

import hashlib
import os
import secrets

import torch
from torch import nn

from .fingerprint import CacheConfig
from .kv_index import BlockIndex, index_bytes
from .kv_layout import KVLayout, plan_layout


def fingerprint_digest(cfg: CacheConfig) -> bytes:
    """32 bytes naming the weights a pool may serve (written in its index header)."""
    return hashlib.sha256(cfg.model_dump_json().encode()).digest()


def layout_for(model: nn.Module, pool_bytes: int, block_size: int, dtype: str, scratch_slots: int) -> KVLayout:
    """The pool layout for `model` (built on meta for this rank: its own KV heads)."""
    attn = model.model.layers[0].self_attn
    return plan_layout(pool_bytes, block_size, len(model.model.layers), attn.kv_heads, attn.head_dim, dtype,
                       scratch_slots)


class KVPool:
    """The daemon's pool and index; `fds()` are what `kv_attach` hands to engines."""

    def __init__(self, layout: KVLayout, fingerprint: bytes, device: torch.device, rank: int) -> None:
        self.layout = layout
        self.pool_id = secrets.token_bytes(16)
        if device.type == "cpu":  # a memfd of zero pages: memory is taken as engines write blocks
            self._arena = None
            self._fd = os.memfd_create(f"understudy-kv-rank{rank}", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, layout.pool_bytes)
            self.size = layout.pool_bytes
        else:
            from .transport_cuda import CudaArena

            self._arena = CudaArena(layout.pool_bytes, device.index or 0)
            self._arena.region.zero_()  # every block finite: a masked-out position times 0 stays 0
            self._arena.finish()
            self._fd, self.size = self._arena.export_fd(), self._arena.size
        self.index_bytes = index_bytes(layout.num_blocks, layout.block_size)
        self._index_fd = os.memfd_create(f"understudy-kv-index-rank{rank}", os.MFD_CLOEXEC)
        os.ftruncate(self._index_fd, self.index_bytes)
        index = BlockIndex(self._index_fd, self.index_bytes, layout)
        index.initialise(layout, fingerprint, self.pool_id)
        index.close()

    def fds(self) -> tuple[int, int]:
        """(pool, index): stay owned by this object."""
        return self._fd, self._index_fd
