"""What a new primary would otherwise do for the first time in its first steps after a failover,
done once at startup instead (UNDERSTUDY_WARM_FIRST_USE: a comma list of `sampling`, `graphs`).

A parked standby has served only its canary: one row at a time. Promoted, it draws for up to
max_num_seqs rows at once, with torch's caching allocators (device memory and pinned host memory)
asked for buffers they never held; and it replays CUDA graphs it captured but never ran. CUDA loads
a kernel on its first call. Whether these first uses slow a new primary's first steps is not yet
measured (bench/RESULTS.md, nineteenth session): off by default until it is. (The index kernels
of the pending tokens' gather and of the tails' copies are always called at startup:
engines/core/runner.py `_warm_index_kernels`.)"""
from __future__ import annotations

import logging
import os
import time

import torch

from .engine import LLMEngine
from .inflight import InFlight
from .sample_guard import greedy_picks, guarded_sample
from .sampling import SamplingParams

log = logging.getLogger("engines.core.first_use")
WHAT = ("sampling", "graphs")


def asked() -> list[str]:
    """What UNDERSTUDY_WARM_FIRST_USE names (ValueError for anything else)."""
    names = [n.strip() for n in os.environ.get("UNDERSTUDY_WARM_FIRST_USE", "").split(",") if n.strip()]
    if unknown := [n for n in names if n not in WHAT]:
        raise ValueError(f"UNDERSTUDY_WARM_FIRST_USE: {', '.join(unknown)} not one of {', '.join(WHAT)}")
    return names


def warm(engine: LLMEngine, names: list[str]) -> None:
    """Do what `names` says on the engine's device (nothing off CUDA), then wait for it; logged."""
    runner = engine.runner
    if runner.device.type != "cuda" or not names:
        return
    if "graphs" in names and runner.tp_size > 1:  # (a replay under TP needs every rank: not done here)
        log.info("graphs not replayed at startup: tp_size %d", runner.tp_size)
        names = [n for n in names if n != "graphs"]
    t0, before = time.perf_counter(), torch.cuda.memory_reserved(runner.device)
    if "sampling" in names:
        warm_sampling(engine, runner.max_seqs)
    if "graphs" in names:
        runner.replay_graphs()
    torch.cuda.synchronize(runner.device)
    log.info("warmed %s in %.1f ms; torch's allocator holds %.0f MiB (%.0f before)", ", ".join(names),
             (time.perf_counter() - t0) * 1e3, torch.cuda.memory_reserved(runner.device) / 2**20, before / 2**20)


def warm_sampling(engine: LLMEngine, rows: int) -> None:
    """Draws for `rows` rows with temperature, top-k and top-p, for the same rows half of them
    greedy, and for one row, each with its copy to the host, as steps make them (two in flight)."""
    model = engine.runner.model
    logits = torch.zeros(rows, model.args.vocab_size, dtype=model.dtype, device=engine.runner.device)
    drawn = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i) for i in range(rows)]
    mixed = [p if i % 2 else SamplingParams(temperature=0) for i, p in enumerate(drawn)]
    flights = []
    for params in (drawn, mixed, drawn[:1], drawn):
        n = len(params)
        tokens, read_back, _ = guarded_sample(engine.sampler, logits[:n], greedy_picks(logits[:n]), params,
                                              list(range(n)))
        flights.append(InFlight.launch([], tokens, read_back))
    for flight in flights:
        flight.wait()
