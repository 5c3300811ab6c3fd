"""Does a kernel's first call in a process wait for the work already on the GPU? (CUDA loads a
kernel on its first call under lazy loading, torch's default, and loading may synchronize the
context.) The promotion traces of bench/RESULTS.md (nineteenth session) show one launch of 14-26 ms
in most new primaries' first steps, at the first step after their batch changed, when the previous
step's tokens are gathered into new rows (engines/core/runner.py `_gather_pending`: index kernels that
no unchanging batch runs).

Also (twenty-first session): a pageable host list's copy to the device against a pinned one
(engines/core/device_upload.py `to_device`), and index_select over a KV layer with 1 index, then 17
(torch has a kernel for up to 16 indices and another for more: on an H100 the schedule phase of a
new primary's first step of more than 16 rows, copying their tails, took a median 25.9 ms against
8.6 ms without tails, bench/RESULTS.md, twenty-first session).

For each op below, in a fresh process: enqueue ~--busy-ms of matrix products, then time the host's
call of the op (its launch only: nothing waits for the device), the first time and twice again.

    python3 bench/probes/first_kernel.py [--busy-ms 10]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from engines.core.device_upload import to_device


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy-ms", type=float, default=10.0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    products = max(1, round(args.busy_ms / ((time.perf_counter() - t) * 1e3 / 20)))  # about busy_ms of them
    prev = torch.zeros(256, dtype=torch.long, device=dev)
    rows = torch.arange(255, -1, -1, device=dev)
    logits = torch.randn(256, 32000, device=dev, dtype=torch.bfloat16)
    layer = torch.zeros(2, 4096, 16, 8, 128, device=dev, dtype=torch.bfloat16)  # [2, blocks, block_size, heads, dim]
    blocks = torch.arange(64, device=dev)
    ops = {
        "index_copy_ + index_select (the gather of a changed batch)":
            lambda: torch.zeros_like(prev).index_copy_(0, rows[:128], prev.index_select(0, rows[128:])),
        "sort (top-k / top-p)": lambda: logits.float().sort(dim=-1, descending=True),
        "cumsum + softmax": lambda: logits.float().softmax(dim=-1).cumsum(dim=-1),
        "a host list to the device (pageable)": lambda: torch.tensor(list(range(256))).to(dev, non_blocking=True),
        "a host list to the device (pinned: device_upload.to_device)": lambda: to_device(list(range(256)), dev),
        "index_select of a KV layer, 1 index": lambda: layer.index_select(1, blocks[:1]),
        "index_select of a KV layer, 17 indices (after 1)": lambda: layer.index_select(1, blocks[:17]),
        "index_copy_ of a KV layer, 17 indices": lambda: layer.index_copy_(1, blocks[17:34], layer[:, :17]),
    }
    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset: torch sets LAZY)')}; "
          f"{torch.cuda.get_device_name()}; each op's call timed behind ~{args.busy_ms:g} ms of queued products")
    for name, op in ops.items():
        took = []
        for _ in range(3):
            torch.cuda.synchronize()
            for _product in range(products):
                a @ a
            t = time.perf_counter()
            op()
            took.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        print(f"  {name}: first call {took[0]:.2f} ms, second {took[1]:.2f} ms, third {took[2]:.2f} ms")


if __name__ == "__main__":
    main()
