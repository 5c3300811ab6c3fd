"""Weights for one rank through daemon/'s attach: `client`, `daemon` or `off` (DESIGN.md §2)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from daemon.fingerprint import CacheConfig, make_cache_config

from wire.engine_config import EngineConfig
from models import CausalLM, ModelArgs, build_model, torch_dtype


@dataclass
class RankWeights:
    """The materialised model of one rank, where its weights came from, and what keeps them mapped."""

    model: CausalLM
    source: str  # "cache_hit" | "disk:<miss reason>" | "disk:off"
    timings: dict
    keepalive: object
    cache_config: CacheConfig  # this rank's fingerprint (the KV pool is attached with it too)


def load_rank_weights(cfg: EngineConfig, args: ModelArgs, rank: int, device: torch.device) -> RankWeights:
    """Build this rank's model on meta and fill it from the daemon's arena or from disk."""
    from daemon.client import attach_or_load

    dtype = torch_dtype(cfg.dtype)
    model = build_model(args, tp_rank=rank, tp_size=cfg.tp_size, dtype=dtype, device="meta")
    cache_config = make_cache_config(cfg.model_path, tp_rank=rank, tp_size=cfg.tp_size, dtype=cfg.dtype,
                                     device=str(device))
    result = attach_or_load(model, cache_config, cfg.weight_cache_mode, cfg.runtime_dir, rank, str(device))
    if not result.source.startswith("cache_hit"):  # the daemon checked its arena; our own load we check here
        from daemon.finite import check_finite
        check_finite(model, cfg.model_path)
    return RankWeights(model, result.source, dict(result.timings), result.keepalive, cache_config)


SOURCE_BYTES = 128  # one rank's weight source on the wire (longer ones are cut)


def gather_sources(source: str, group, tp_size: int) -> list[str]:
    """Every rank's weight source, in rank order (a collective on the engine's gloo step group:
    every rank calls it). A fixed-size byte tensor, not `all_gather_object`, which pickles."""
    if tp_size == 1:
        return [source]
    import torch.distributed as dist

    mine = torch.zeros(SOURCE_BYTES, dtype=torch.uint8)
    raw = source.encode()[:SOURCE_BYTES]
    mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.zeros_like(mine) for _ in range(tp_size)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in out]


def engine_source(sources: list[str], want: str = "cache_hit") -> str:
    """The engine's source from every rank's: `want` (the weights' `cache_hit`, the KV's `shared`)
    only if every rank got it, else the first rank's miss (a TP engine that read one rank from disk
    did not start from the cache)."""
    return next((s for s in sources if s != want), sources[0])
