"""What a block's index writes cost the writer's scheduler thread on this host's CPU: `owned` (every
allocation) and `owned` + `sealed` (a block's whole life), over a 65,536-block memfd pool.

    python bench/probes/index_writes.py [--calls 200000] [--runs 3]
"""
from __future__ import annotations

import argparse
import timeit

import torch

from daemon.kv_index import BlockIndex
from daemon.kv_layout import KVLayout
from daemon.kv_pool import KVPool

FP = b"f" * 32


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    lay = KVLayout(num_blocks=65536, block_size=16, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                   scratch_slots=2, scratch_blocks=32)
    pool = KVPool(lay, FP, torch.device("cpu"), 0)
    try:
        index = BlockIndex(pool.fds()[1], pool.index_bytes, lay)
    except TypeError:  # (a tree before the index's tails: no layout argument)
        index = BlockIndex(pool.fds()[1], pool.index_bytes)
    index.claim(lay, FP)
    for _ in range(a.runs):
        owned = timeit.timeit(lambda: index.owned(1000, 5), number=a.calls) / a.calls
        both = timeit.timeit(lambda: (index.owned(1001, 7), index.sealed(1001, 7, 12345, 678, 9)),
                             number=a.calls) / a.calls
        print(f"owned {owned * 1e6:.3f} us a call, owned + sealed {both * 1e6:.3f} us a block")


if __name__ == "__main__":
    main()
