"""What naming every sequence's tail costs a writer's scheduler thread per decode step, on this host's
CPU (no model, no GPU): `TailPublisher.record` and `.publish` (engines/core/tail_publisher.py) beside the seal
loop that the same step already runs (`BlockManager.seal` for each row), for steps of N decode rows
over a writer's shared pool (memfd).

    python bench/probes/tail_cost.py [--rows 32 256] [--steps 400] [--runs 5]
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from daemon.kv_index import BlockIndex
from daemon.kv_layout import KVLayout
from daemon.kv_pool import KVPool
from engines.core.block_manager import BlockManager
from engines.kv.publish import Publisher
from engines.core.tail_publisher import TailPublisher
from engines.models.make_model import make_model
from engines.core.sampling import SamplingParams
from engines.core.scheduler import Scheduled
from engines.core.sequence import Sequence
from engines.core.tokenizer import Tokenizer

from promote_cost import FP  # (bench/probes: run from the repository root)

BS = 16


def run(rows: int, steps: int, tokenizer: Tokenizer, rng: random.Random) -> tuple[float, float]:
    """Median µs per step of the seal loop and of the tails' record + publish, over `steps` steps."""
    lay = KVLayout(num_blocks=rows * 64 + 100, block_size=BS, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                   scratch_slots=2, scratch_blocks=32)
    pool = KVPool(lay, FP, torch.device("cpu"), 0)
    index = BlockIndex(pool.fds()[1], pool.index_bytes, lay)
    bm = BlockManager(lay.num_blocks, BS, True, scratch=lay.scratch(0), shared=lay.shared_blocks)
    bm.become_writer(index.claim(lay, FP), index, Publisher(index, bm.gens, torch.device("cpu")))
    tails = TailPublisher(bm)
    params = SamplingParams(temperature=0.0, max_tokens=4096)
    seqs = []
    for _ in range(rows):
        s = Sequence([rng.randrange(1000) for _ in range(rng.randint(200, 400))], params, tokenizer, set(), 8192,
                     lambda o: None)
        bm.match_prefix(s)
        bm.grow(s, len(s.prompt_ids))
        s.num_computed = len(s.prompt_ids)
        bm.seal(s)
        seqs.append(s)
    seal_us, tails_us = [], []
    for _ in range(steps):
        work = []
        for s in seqs:
            s.output_ids.append(rng.randrange(1000))
            start = s.num_tokens - 1
            bm.grow(s, start + 1)
            s.num_computed = start + 1
            work.append(Scheduled(s, start, 1))
        slots = np.array([s.block_table[w.start // BS] * BS + w.start % BS for s, w in zip(seqs, work)])
        ids = np.zeros(len(work), dtype=np.int64)  # every row pending: its token comes from the previous step
        sampled = np.array([s.output_ids[-1] for s in seqs])
        t0 = time.perf_counter()
        tails.publish()
        t1 = time.perf_counter()
        for w in work:
            bm.seal(w.seq)
        t2 = time.perf_counter()
        tails.record(work, slots, ids, list(range(len(work))), list(range(len(work))), True, sampled)
        t3 = time.perf_counter()
        seal_us.append((t2 - t1) * 1e6)
        tails_us.append((t1 - t0 + t3 - t2) * 1e6)
    index.close()
    return statistics.median(seal_us), statistics.median(tails_us)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    tokenizer = Tokenizer(make_model(Path(tempfile.mkdtemp()), "tiny", "llama", seed=0))
    print("rows | seal loop µs/step (median of runs) | tails record+publish µs/step | each run's tails")
    for rows in a.rows:
        got = [run(rows, a.steps, tokenizer, random.Random(i)) for i in range(a.runs)]
        seal = statistics.median(g[0] for g in got)
        tail = statistics.median(g[1] for g in got)
        print(f"{rows} | {seal:.1f} | {tail:.1f} | {', '.join(f'{g[1]:.1f}' for g in got)}")


if __name__ == "__main__":
    main()
