"""What a promotion costs in the engine with a full shared pool, part by part, on this host's CPU (no
GPU: a memfd pool): the index claim (read and check every entry), then the block manager's adoption.

    python bench/probes/promote_cost.py [--blocks 65536] [--sealed 65000] [--runs 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from daemon.kv_index import BlockIndex
from daemon.kv_layout import KVLayout
from daemon.kv_pool import KVPool
from engines.block_manager import BlockManager
from engines.kv_publish import Publisher


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=65536)
    p.add_argument("--sealed", type=int, default=65000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--heap-objects", type=int, default=0,
                   help="long-lived objects made first, as an engine's process holds (torch, the model)")
    a = p.parse_args()
    heap = [[i] for i in range(a.heap_objects)]  # (kept alive to the end: the collector scans them)
    lay = KVLayout(num_blocks=a.blocks, block_size=16, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                   scratch_slots=2, scratch_blocks=32)
    pool = KVPool(lay, b"f" * 32, torch.device("cpu"), 0)
    index = BlockIndex(pool.fds()[1], pool.index_bytes)
    index.claim(lay, b"f" * 32)
    for b in range(lay.shared_start, min(lay.num_blocks, lay.shared_start + a.sealed)):
        gen = 1000 + b % 3000  # (a pool in use for a while: blocks allocated many times over)
        index.owned(b, gen)
        index.sealed(b, gen, b * 7919 + 1, (b * 31) << 40, b)
    claims, adopts = [], []
    for _ in range(a.runs):
        t = time.perf_counter()
        adoption = index.claim(lay, b"f" * 32)
        claims.append(time.perf_counter() - t)
        bm = BlockManager(lay.num_blocks, 16, scratch=lay.scratch(0), shared=lay.shared_blocks)
        t = time.perf_counter()
        bm.become_writer(adoption, index, Publisher(index, bm.gens, torch.device("cpu")))
        adopts.append(time.perf_counter() - t)
    del heap
    print(f"{a.blocks} blocks, {len(adoption.sealed)} keyed, {a.heap_objects} objects on the heap: claim median {statistics.median(claims) * 1e3:.1f} ms, "
          f"adopt median {statistics.median(adopts) * 1e3:.1f} ms (runs {a.runs}; first claim "
          f"{claims[0] * 1e3:.1f}, first adopt {adopts[0] * 1e3:.1f})")


if __name__ == "__main__":
    main()
