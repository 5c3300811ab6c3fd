"""Sampled tokens still on their way from the device: the engine launches step k+1 before it
reads step k's tokens, so the CPU's per-step work (stop rules, detokenizing, streaming) runs
while the GPU computes instead of between its steps."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class InFlight:
    """The tokens one launch sampled for `seqs` (row i for seqs[i]), and their copy to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # on the device; the next decode reads its input ids from here
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor) -> InFlight:
        """Start the device-to-host copy of `tokens` without waiting for it."""
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, tokens, None)
        host = tokens.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream, whatever thread this is
        return cls(seqs, tokens, host, ready)

    def wait(self) -> list[int]:
        """The tokens on the host (blocks until the step that sampled them has run)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
