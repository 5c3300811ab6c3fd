"""Attach this rank's shared KV pool at startup (DESIGN.md §2 "The KV pool"), or say why not."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from daemon.client import CacheMiss
from daemon.fingerprint import CacheConfig
from daemon.kv_attach import KVPoolMapping, attach_kv_pool

from wire.engine_config import EngineConfig
from models import CausalLM
from .weights import engine_source, gather_sources

log = logging.getLogger("engines.process.pool_attach")

ATTACH_WAIT_S = 60.0  # a daemon still loading answers `loading` meanwhile


def attach_rank_pool(cfg: EngineConfig, model: CausalLM, cache_config: CacheConfig, rank: int,
                     device: torch.device, group: dist.ProcessGroup | None) -> tuple[KVPoolMapping | None, str]:
    """This rank's shared pool and the engine's KV source: `shared` when every rank mapped its pool,
    else `own` (shared_kv off) or `own:<miss reason>` (and no rank uses its pool: they must agree)."""
    mapping, source = None, "own"
    if cfg.shared_kv:
        attn = model.model.layers[0].self_attn
        expected = {"block_size": cfg.kv_block_size, "layers": len(model.model.layers), "kv_heads": attn.kv_heads,
                    "head_dim": attn.head_dim, "dtype": cfg.dtype}
        try:
            mapping = attach_kv_pool(cache_config, expected, cfg.runtime_dir, rank, device, wait_s=ATTACH_WAIT_S,
                                     with_index=rank == 0)
            source = "shared" if cfg.kv_slot < mapping.layout.scratch_slots else "own:no_slot"
        except CacheMiss as miss:
            log.warning("rank %d: no shared KV pool (%s): %s; this engine allocates its own KV cache",
                        rank, miss.reason, miss)
            source = f"own:{miss.reason}"
    source = engine_source(gather_sources(source, group, cfg.tp_size), want="shared")
    return (mapping if source == "shared" else None), source
