"""Sampled tokens still on their way from the device: the engine launches step k+1 before it
reads step k's tokens, so the CPU's per-step work (stop rules, detokenizing, streaming) runs
while the GPU computes instead of between its steps."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sequence import Sequence


@dataclass
class InFlight:
    """The tokens one launch sampled for `seqs` (row i for seqs[i]), and their copy to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # on the device; the next decode reads its input ids from here
    host: torch.Tensor
    ready: torch.cuda.Event | None
    host_finite: torch.Tensor | None = None  # row i's logits were all finite (engines/sample_guard.py)
    errors: dict[int, str] = field(default_factory=dict)  # rows whose sampling raised

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor, finite: torch.Tensor | None = None,
               errors: dict[int, str] | None = None) -> InFlight:
        """Start the device-to-host copy of `tokens` (and their finite flags) without waiting for it."""
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, tokens, None, finite, errors or {})
        host = tokens.to("cpu", non_blocking=True)
        host_finite = finite.to("cpu", non_blocking=True) if finite is not None else None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream, whatever thread this is
        return cls(seqs, tokens, host, ready, host_finite, errors or {})

    def wait(self) -> list[int]:
        """The tokens on the host (blocks until the step that sampled them has run)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def failed_rows(self) -> dict[int, str]:
        """After ``wait``: {row: why} for the rows whose token must not be used."""
        bad = dict(self.errors)
        if self.host_finite is not None and not bool(self.host_finite.all()):
            from .sample_guard import NONFINITE
            for i, ok in enumerate(self.host_finite.tolist()):
                if not ok:
                    bad.setdefault(i, NONFINITE)
        return bad
