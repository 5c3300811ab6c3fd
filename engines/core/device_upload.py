"""Small host lists (row and block indices, sampling parameters) to the device without waiting for
the step in flight.

A copy from pageable host memory to the device is staged by CUDA through pinned memory, and "a
stream sync is performed before the copy is initiated" (CUDA's API synchronization behavior), so
`torch.tensor(ids).to(device, non_blocking=True)` may hold the scheduler thread until the device has
run everything launched before: the step just launched, which undoes the overlap of one step's
host work with the previous step on the device. These lists are written into pinned memory from
torch's caching host allocator instead, which hands a buffer out again only once the device has
copied from it."""
from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` on `device`; work enqueued after this on the current stream reads them."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)
