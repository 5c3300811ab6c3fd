"""Why a shared-KV primary serves slower than an engine with its own KV (issue 20's 3% target): the
same steady decode (step_profile.py's loop: BATCH rows past a shared prefix, a new request every 4
steps) on one engine per variant, in turn, in one process:

    own        its own KV cache (torch's allocator), POOL_GIB
    own-half   its own KV cache, half of POOL_GIB (the split that shared_kv: false gives each engine)
    writer     the writer of a shared pool (index in a memfd, as the daemon's) naming its tails
               (engines.kv_tails), over a region from torch's allocator: the host side of the shared
               KV (index writes, tails, events) alone
    writer-vmm the same over a CUDA VMM region (the daemon's kind of memory): + the memory's kind
    writer-notails  writer without its tails (kv_tails: false, the default): what naming them costs

The default variants are all but writer-notails. Prints per variant the median wall per step and each phase's mean per step (ms), the variants'
order rotated each round.

    python bench/probes/writer_steps.py MODEL_DIR [--pool-gib 16] [--batch 32] [--context 300] [--rounds 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from step_profile import PHASES, instrument, run_steps, timed  # noqa: E402

from daemon.kv_attach import KVPoolMapping  # noqa: E402
from daemon.kv_index import BlockIndex  # noqa: E402
from daemon.kv_pool import KVPool, layout_for  # noqa: E402
from engines.engine import LLMEngine  # noqa: E402
from engines.inflight import InFlight  # noqa: E402
from engines.runner import ModelRunner  # noqa: E402
from engines.shared_kv import SharedPool  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from harness.bench.decode import local_weights  # noqa: E402

VARIANTS = ("own", "own-half", "writer", "writer-vmm", "writer-notails")
FINGERPRINT = b"writer-steps-probe".ljust(32, b"\0")


def build(variant: str, model, tokenizer: Tokenizer, device: torch.device, pool_bytes: int,  # noqa: ANN001
          max_len: int, seqs: int) -> tuple[LLMEngine, object]:
    runner = ModelRunner(model, device)
    keep = None
    if variant.startswith("own"):
        runner.allocate_kv_cache(pool_bytes // (2 if variant == "own-half" else 1), 16, max_len, seqs, 2048)
        pool = None
    else:
        layout = layout_for(model, pool_bytes, 16, str(model.dtype).removeprefix("torch."), 2)
        index_owner = KVPool(layout, FINGERPRINT, torch.device("cpu"), 0)  # (its memfd region stays sparse)
        if variant == "writer-vmm" and device.type == "cuda":
            from daemon.transport_cuda import CudaArena
            keep = CudaArena(layout.pool_bytes, device.index or 0)
            region = keep.region
            region.zero_()
        else:
            region = torch.zeros(layout.pool_bytes, dtype=torch.uint8, device=device)
        _, index_fd = index_owner.fds()
        mapping = KVPoolMapping(layout, region, BlockIndex(index_fd, index_owner.index_bytes, layout), FINGERPRINT,
                                "probe", (keep, index_owner))
        runner.allocate_kv_cache(0, 16, max_len, seqs, 2048, mapping)
        pool = SharedPool(mapping, 0, tails=variant != "writer-notails")
    if device.type == "cuda":
        runner.capture_graphs()
    engine = LLMEngine(runner, tokenizer, max_len, seqs, pool=pool)
    assert engine.promote()[0] == "promoted"
    engine.trace.since = None  # (the promotion's trace times each step of its first second: not serving's cost)
    instrument(engine)
    for name in ("seal", "launched", "publish_completed"):
        setattr(engine.blocks, name, timed(name, getattr(engine.blocks, name)))
    for name in ("record", "publish") if engine.tails else ():
        setattr(engine.tails, name, timed(f"tails.{name}", getattr(engine.tails, name)))
    return engine, keep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--pool-gib", type=float, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default=",".join(VARIANTS[:4]))
    ns = ap.parse_args()
    variants = tuple(ns.variants.split(","))
    InFlight.wait = timed("  of which GPU wait", InFlight.wait)  # (the class's: every engine's)
    weights, _, device = local_weights(ns.model_dir, ns.device, max_num_seqs=64, max_len=2048)
    tokenizer = Tokenizer(ns.model_dir)
    walls: dict[str, list[float]] = {v: [] for v in variants}
    phases: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    for r in range(ns.rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            engine, keep = build(variant, weights.model, tokenizer, device, int(ns.pool_gib * 2**30), 2048,
                                  max(64, ns.batch))
            run_steps(engine, ns.batch, ns.context, 40, 4)  # warm-up
            walls[variant].append(run_steps(engine, ns.batch, ns.context, ns.steps, 4) * 1e3)
            for name, times in PHASES.items():
                phases[variant].setdefault(name, []).append(sum(times) / ns.steps * 1e3)
            print(f"round {r + 1} {variant}: {walls[variant][-1]:.3f} ms/step", flush=True)
            weights.model.kv_cache = None
            del engine, keep
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    names = list(dict.fromkeys(n for v in variants for n in phases[v]))
    print(f"batch {ns.batch}, context {ns.context}, a new request every 4 steps, {ns.steps} steps x {ns.rounds} "
          "rounds; ms per step (median of rounds; phases: mean per step)")
    print(f"{'phase':28}" + "".join(f"{v:>12}" for v in variants))
    print(f"{'wall (median step)':28}" + "".join(f"{statistics.median(walls[v]):12.3f}" for v in variants))
    for n in names:
        print(f"{n:28}" + "".join(f"{statistics.median(phases[v][n]):12.3f}" if n in phases[v] else f"{'-':>12}"
                                  for v in variants))


if __name__ == "__main__":
    main()
