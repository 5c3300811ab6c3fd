"""Where a scheduler step's time goes on the GPU machine, at the shapes of the shared-prefix load
(decode rows with ~1.6k tokens of context, and a new request's prefill riding along): wall time
per step, the CPU phases of `LLMEngine.step` (the GPU wait apart), and the CUDA kernels by time.

    python bench/probes/step_profile.py MODEL_DIR [--batches 1,32] [--context 1532]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time

import torch

from harness.bench.decode import local_engine
from engines.core.inflight import InFlight
from engines.core.sampling import SamplingParams
from engines.core.sequence import Sequence

PHASES: dict[str, list[float]] = collections.defaultdict(list)


def timed(name: str, fn):  # noqa: ANN001, ANN201
    def wrapper(*a, **k):  # noqa: ANN002, ANN003
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PHASES[name].append(time.perf_counter() - t)
    return wrapper


def instrument(engine) -> None:  # noqa: ANN001
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.runner.prepare = timed("prepare", engine.runner.prepare)
    engine.runner.run = timed("run (launch)", engine.runner.run)
    engine._sample = timed("sample (launch)", engine._sample)
    engine._read_back = timed("read back (incl. GPU wait)", engine._read_back)
    engine._flush = timed("flush", engine._flush)


def seq(engine, ids: list[int], max_tokens: int) -> Sequence:  # noqa: ANN001
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Sequence(ids, p, engine.tokenizer, set(), engine.max_model_len, lambda o: None)


def run_steps(engine, batch: int, context: int, steps: int, arrivals_every: int,  # noqa: ANN001
              steady=contextlib.nullcontext) -> float:  # noqa: ANN001
    """`batch` sequences decode past `context` tokens of a shared prefix; every `arrivals_every`
    steps (0: never) one more arrives (32 new tokens after the prefix) and the oldest is aborted.
    Returns the median wall seconds per step."""
    vocab = engine.tokenizer.vocab_size
    prefix = [(i * 7919) % (vocab - 10) + 10 for i in range(context)]
    running = []
    for i in range(batch):
        s = seq(engine, prefix + [10 + (i * 31 + j) % (vocab - 10) for j in range(32)], 10_000)
        engine.scheduler.add(s)
        running.append(s)
    while any(s.num_tokens <= len(s.prompt_ids) for s in running) or engine.scheduler.waiting:
        engine.step()
    PHASES.clear()
    walls = []
    with steady():
        for k in range(steps):
            if arrivals_every and k % arrivals_every == 0:
                old = running.pop(0)
                engine.scheduler.abort(old.seq_id)
                old.abort()
                s = seq(engine, prefix + [10 + (k * 17 + j) % (vocab - 10) for j in range(32)], 10_000)
                engine.scheduler.add(s)
                running.append(s)
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    for s in running:
        engine.scheduler.abort(s.seq_id)
        s.abort()
    while engine.has_work:
        engine.step()
    return statistics.median(walls)


def kernels(engine, batch: int, context: int, arrivals_every: int = 4) -> None:  # noqa: ANN001
    """The kernels of 20 steady steps (setup apart), GPU us per step."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CUDA])
    run_steps(engine, batch, context, 20, arrivals_every, steady=lambda: prof)
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    print(f"GPU us per step: {total / 20:.1f}")
    for e in rows[:16]:
        print(f"{e.device_time_total / 20:8.1f} us/step {e.count / 20:5.1f} calls/step  {e.key[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=1532)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args()
    batches = [int(b) for b in ns.batches.split(",")]
    InFlight.wait = timed("  of which GPU wait", InFlight.wait)  # the class's: once for both engines
    rows = []
    for graphs in (True, False) if ns.device == "cuda" else (False,):
        engine = local_engine(ns.model_dir, ns.device, max_num_seqs=64, max_len=2048, kv_cache_bytes=8 << 30,
                              cuda_graphs=graphs)
        instrument(engine)
        for b in batches:
            for every in (0, 4):
                run_steps(engine, b, ns.context, 20, every)  # warm-up
                wall = run_steps(engine, b, ns.context, ns.steps, every)
                ph = {k: statistics.median(v) * 1e3 for k, v in PHASES.items()}
                rows.append((graphs, b, every, wall * 1e3, ph))
        if ns.device != "cuda":
            continue
        print(f"== kernels, cuda_graphs={graphs}, batch {batches[-1]}, a new request every 4 steps", flush=True)
        kernels(engine, batches[-1], ns.context)
        del engine
        torch.cuda.empty_cache()
    print("graphs batch arrivals  wall_ms  " + "  ".join(rows[0][4]))
    for graphs, b, every, wall, ph in rows:
        print(f"{graphs!s:6} {b:5} {every or '-':>8} {wall:8.3f}  " + "  ".join(f"{v:.3f}" for v in ph.values()))


if __name__ == "__main__":
    main()
