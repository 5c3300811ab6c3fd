"""Small lists of ints (row and block indices) to the device without waiting for the step in flight.

`torch.tensor(ids).to(device, non_blocking=True)` copies from pageable memory, which CUDA first
stages through pinned memory, and may synchronize with the stream to do so: the scheduler thread
would then wait for the step the device is running before it can launch the next. An `Upload` copies
through a pinned buffer of its own instead, written again only once the device has taken the last
copy from it (an event: by then it has, a step or more ago, so the wait is nil in practice)."""
from __future__ import annotations

import torch


class Upload:
    """A pinned host buffer and its device twin, for one kind of index list (reused each call)."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device, self.capacity = device, capacity
        cuda = device.type == "cuda"
        self._host = torch.zeros(capacity, dtype=torch.long, pin_memory=cuda)
        self._dev = torch.zeros(capacity, dtype=torch.long, device=device)
        self._taken = torch.cuda.Event() if cuda else None  # the device has copied the last values

    def __call__(self, values: list[int]) -> torch.Tensor:
        """`values` on the device (at most `capacity` of them): a view valid until the next call;
        work enqueued after this call on the current stream reads them."""
        n = len(values)
        if n > self.capacity:
            raise ValueError(f"{n} values for an upload of {self.capacity}")
        if self._taken is not None:
            self._taken.synchronize()
        self._host.numpy()[:n] = values
        out = self._dev[:n]
        out.copy_(self._host[:n], non_blocking=True)
        if self._taken is not None:
            self._taken.record()
        return out
