"""Engine side of the shared KV pool: map one rank's pool (read-write) and its block index from the
rank's daemon. Every miss is a CacheMiss naming its reason, like the weights' attach."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from .client import CacheMiss, open_session, when_ready
from .fingerprint import CacheConfig
from .framing import close_fds
from .kv_index import BlockIndex, UntrustedIndex
from .kv_layout import KVLayout
from .kv_pool import fingerprint_digest
from .protocol import KVAttach
from .runtime_dir import daemon_socket_path

# What the engine's model decides about a pool; the daemon decides the block count and the slots.
MODEL_FIELDS = ("block_size", "layers", "kv_heads", "head_dim", "dtype")


@dataclass
class KVPoolMapping:
    """A rank's pool as an engine maps it; keep `keepalive` referenced as long as the pool is used."""

    layout: KVLayout
    region: torch.Tensor  # uint8, read-write, at least layout.pool_bytes
    index: BlockIndex | None  # rank 0 only: the writer's index
    fingerprint: bytes
    pool_id: str
    keepalive: object


def attach_kv_pool(cache_config: CacheConfig, expected: dict, runtime_dir: str | os.PathLike, rank: int,
                   device: torch.device, *, wait_s: float, with_index: bool) -> KVPoolMapping:
    """Map the rank's KV pool; `expected` holds this engine's MODEL_FIELDS. CacheMiss on any miss."""
    path = daemon_socket_path(runtime_dir, rank)
    with open_session(path) as sock:
        reply, fds = when_ready(sock, KVAttach(fingerprint=cache_config), path, wait_s)
    try:
        handle = reply.kv_pool
        layout = handle.layout
        differ = [f"{f} (ours {expected[f]!r}, pool {getattr(layout, f)!r})" for f in MODEL_FIELDS
                  if getattr(layout, f) != expected[f]]
        if differ:
            raise CacheMiss("mismatch", f"the KV pool at {path} has another layout: {', '.join(differ)}")
        if handle.transport != device.type or handle.size < layout.pool_bytes:
            raise CacheMiss("attach_failed", f"the KV pool at {path} is a {handle.size}-byte {handle.transport} "
                                             f"region; this engine needs {layout.pool_bytes} bytes on {device.type}")
        region, keep = _map(fds[0], handle.size, device)
        index = BlockIndex(fds[1], handle.index_bytes, layout) if with_index else None
    except (OSError, RuntimeError, ValueError, ValidationError, UntrustedIndex) as e:
        raise CacheMiss("attach_failed", f"cannot map the KV pool from {path}: {str(e).splitlines()[0]}") from None
    finally:
        close_fds(fds)
    return KVPoolMapping(layout, region, index, fingerprint_digest(cache_config), handle.pool_id, keep)


def _map(fd: int, size: int, device: torch.device) -> tuple[torch.Tensor, object]:
    if device.type == "cpu":
        from .transport_cpu import map_shared

        return map_shared(fd, size)
    from .transport_cuda import map_readwrite

    return map_readwrite(fd, size, device.index or 0)
