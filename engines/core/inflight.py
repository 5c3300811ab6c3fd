"""Sampled tokens still on their way from the device: the engine launches step k+1 before it
reads step k's tokens, so the CPU's per-step work (stop rules, detokenizing, streaming) runs
while the GPU computes instead of between its steps."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sample_guard import NONFINITE
from .sequence import Sequence


@dataclass
class InFlight:
    """The tokens one launch sampled for `seqs` (row i for seqs[i]), and their copy to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # on the device; the next decode reads its input ids from here
    host: torch.Tensor  # the tokens read back: -1 where the row failed (engines/core/sample_guard.py)
    ready: torch.cuda.Event | None
    errors: dict[int, str] = field(default_factory=dict)  # rows whose sampling raised

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor, read_back: torch.Tensor,
               errors: dict[int, str] | None = None) -> InFlight:
        """Start the device-to-host copy of `read_back` without waiting for it."""
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, read_back, None, errors or {})
        host = read_back.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream, whatever thread this is
        return cls(seqs, tokens, host, ready, errors or {})

    def wait(self) -> list[int]:
        """The tokens on the host, -1 for a failed row (blocks until the step that sampled them has run)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def why_failed(self, row: int) -> str:
        """Why row's token is -1: its sampling raised, or else its logits were not finite."""
        return self.errors.get(row, NONFINITE)
