"""Where a restarted engine's graph capture spends its time (GPU machine): each graph's warm-up run
and capture, and optionally a cProfile of it all.

Run it twice: the first run may compile Triton kernels into the disk cache; the second one is what
a restarted standby pays (its kernels are on disk, not yet in the process).

    python bench/probes/graph_warmup.py MODEL_DIR [--warm all|path|first] [--eager-twice] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from engines.core import runner as runner_mod
from engines.models.fused_decode import FUSED_MAX_BATCH
from engines.core.runner import DECODE, MIXED, ModelRunner

TIMES: list[tuple[tuple[int, int], float, float]] = []  # key, warm-up s, capture s


def timed_capture(runner: ModelRunner, warm: str) -> None:
    """A graph capture like runner.capture_graphs (same order, same calls: a copy, kept here so that
    the runner's capture carries no probe's knobs), timed per graph. A warm-up run goes before every
    graph ("all": what the runner did before), before the first of each forward path ("path": what
    it does now) or before the first of each kind ("first")."""
    decode = sorted({b for b in runner_mod.GRAPH_BATCH_SIZES if b < runner.max_seqs} | {runner.max_seqs})
    mixed = sorted({t for t in runner_mod.GRAPH_TOKEN_SIZES if t < runner.max_rows} | {runner.max_rows})
    pool, warmed = None, set()
    for key in [(MIXED, t) for t in reversed(mixed)] + [(DECODE, b) for b in reversed(decode)]:
        host = runner._hosts[0]
        step = runner._graph_step(key, host)
        runner._pad(host.numpy(), step, 0, 0, 0)
        runner._dev[:step.layout.size].copy_(host[:step.layout.size])
        ids, pos, meta = runner._views(step)
        fused = key[0] == DECODE and key[1] <= FUSED_MAX_BATCH and runner.model.use_fused_decode
        path = key if warm == "all" else (key[0], fused and warm == "path")
        t0 = time.perf_counter()
        if path not in warmed:
            warmed.add(path)
            runner._forward(ids, pos, meta)
            torch.cuda.synchronize(runner.device)
        t1 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = runner._forward(ids, pos, meta)
        pool = graph.pool()
        runner.graphs[key] = (graph, out)
        torch.cuda.synchronize(runner.device)
        TIMES.append((key, t1 - t0, time.perf_counter() - t1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--warm", choices=("all", "path", "first"), default="path")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--eager-twice", action="store_true", help="then one more eager run per graph, timed")
    a = ap.parse_args()
    from engines.kernels import preload
    from harness.bench.decode import local_engine
    preload()  # as the spawn server does before it forks an engine
    t0 = time.perf_counter()
    engine = local_engine(a.model, device="cuda", max_num_seqs=a.seqs, max_len=a.max_len, cuda_graphs=False,
                          kv_cache_bytes=2 << 30, max_num_batched_tokens=a.budget)
    runner = engine.runner
    print(f"engine without graphs: {time.perf_counter() - t0:.3f} s")
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    timed_capture(runner, a.warm)
    if prof:
        prof.disable()
    total = time.perf_counter() - t0
    print(f"{'graph':>14} {'warm-up ms':>11} {'capture ms':>11}")
    for (kind, size), warm, cap in TIMES:
        print(f"{('decode' if kind == DECODE else 'mixed') + ' ' + str(size):>14} {warm * 1e3:11.1f} {cap * 1e3:11.1f}")
    print(f"total {total:.3f} s: warm-up runs {sum(t[1] for t in TIMES):.3f}, captures {sum(t[2] for t in TIMES):.3f}")
    if a.eager_twice:
        ts = []
        for key in list(runner.graphs):
            step = runner._graph_step(key, runner._hosts[0])
            t = time.perf_counter()
            runner._forward(*runner._views(step))
            torch.cuda.synchronize(runner.device)
            ts.append(time.perf_counter() - t)
        print(f"one more eager run of every graph's step: {sum(ts):.3f} s")
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    main()
