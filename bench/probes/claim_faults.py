"""Do a claim's page faults come from another process freeing memory? A pool index of 65k keyed
blocks is read (daemon/kv_index.py `_read`, as a claim reads it) every 50 ms, with the heap's
thresholds raised as an engine core's are (engines/heap.py), first alone, then while a child
process maps, touches and frees `--churn-gib` of memory over and over (as a SIGKILLed engine's
exit frees its memory). Per phase: the keys' sort's wall and CPU time and its page faults (median
and max), and the host's NUMA balancing and transparent huge page settings.

    python bench/probes/claim_faults.py [--reads 100] [--churn-gib 8]
"""
from __future__ import annotations

import argparse
import mmap
import multiprocessing
import random
import statistics
import time
from pathlib import Path

import torch

from daemon.kv_index import BlockIndex
from daemon.kv_layout import KVLayout
from daemon.kv_pool import KVPool
from engines.heap import keep_freed_memory

FP = b"f" * 32


def churn(gib: int, stop) -> None:  # noqa: ANN001 (an Event)
    """Map, touch and unmap `gib` GiB until told to stop."""
    while not stop.is_set():
        m = mmap.mmap(-1, gib << 30)
        for at in range(0, gib << 30, 4096):
            m[at] = 1
        m.close()


def reads(index: BlockIndex, lay: KVLayout, n: int) -> list[tuple[float, float, int]]:
    out = []
    for _ in range(n):
        a = index.peek(lay, FP)
        out.append((a.sort_s * 1e3, a.sort_cpu_s * 1e3, a.sort_faults))
        time.sleep(0.05)
    return out


def show(name: str, rows: list[tuple[float, float, int]]) -> None:
    wall, cpu, faults = zip(*rows)
    print(f"{name}: sort median {statistics.median(wall):.1f} ms (CPU {statistics.median(cpu):.1f}), max "
          f"{max(wall):.1f} ms (CPU {cpu[wall.index(max(wall))]:.1f}, {faults[wall.index(max(wall))]} faults); "
          f"faults median {statistics.median(faults)}, max {max(faults)}; reads over 10 ms: "
          f"{sum(w > 10 for w in wall)} of {len(wall)}", flush=True)


def setting(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        return f"({e.strerror})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reads", type=int, default=100)
    p.add_argument("--churn-gib", type=int, default=8)
    a = p.parse_args()
    print("numa_balancing:", setting("/proc/sys/kernel/numa_balancing"), "| THP enabled:",
          setting("/sys/kernel/mm/transparent_hugepage/enabled"), "| defrag:",
          setting("/sys/kernel/mm/transparent_hugepage/defrag"), "| NUMA nodes:",
          len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))
    keep_freed_memory()
    lay = KVLayout(num_blocks=65536, block_size=16, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                   scratch_slots=2, scratch_blocks=32)
    pool = KVPool(lay, FP, torch.device("cpu"), 0)
    writer = BlockIndex(pool.fds()[1], pool.index_bytes, pool.layout)
    writer.claim(lay, FP)
    rng = random.Random(0)
    for block in lay.shared_blocks:
        writer.owned(block, 1)
        writer.sealed(block, 1, rng.getrandbits(63) | 1, rng.getrandbits(64), stamp=block)
    for i in range(0, 40):  # (keys sealed twice, as after a failover)
        writer.owned(lay.shared_start + i, 1)
        writer.sealed(lay.shared_start + i, 1, int(writer.entries[lay.shared_start + 100 + i]["key_lo"]),
                      int(writer.entries[lay.shared_start + 100 + i]["key_hi"]), stamp=10**6 + i)
    index = BlockIndex(pool.fds()[1], pool.index_bytes, pool.layout)
    show("alone", reads(index, lay, a.reads))
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    child = ctx.Process(target=churn, args=(a.churn_gib, stop))
    child.start()
    try:
        time.sleep(1.0)
        show(f"while another process maps and frees {a.churn_gib} GiB", reads(index, lay, a.reads))
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()


if __name__ == "__main__":
    main()
