"""Sampling parameters of one sequence and the batched sampler (greedy, temperature, top-k, top-p, seed)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """What the server validated; temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1


class Sampler:
    """Picks the next token for each row of a logits batch.

    Greedy rows take argmax. Other rows are scaled by temperature, cut by top-k and top-p, and
    drawn from their own torch.Generator (seeded by the request's seed, else randomly), so a
    seeded request gives the same tokens whatever else is in the batch.
    """

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """The chosen token ids `[B]`, on the logits' device (nothing waits for the device here)."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return logits.argmax(dim=-1)  # the dtype's values widen exactly: same argmax as float32
        logits = logits.float()
        out = logits.argmax(dim=-1)
        sub = logits.index_select(0, to_device(rows, logits.device))
        temp = to_device([params[i].temperature for i in rows], logits.device, torch.float32).unsqueeze(1)
        probs = self._filtered_probs(sub / temp, [params[i] for i in rows])
        for j, i in enumerate(rows):
            out[i] = torch.multinomial(probs[j], 1, generator=generators[i]).squeeze(0)
        return out

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax after masking everything outside each row's top-k and top-p nucleus."""
        vocab = logits.shape[-1]
        ks = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], logits.device)
        ps = to_device([p.top_p for p in params], logits.device, logits.dtype)
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(before >= ps.unsqueeze(1), float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
        return filtered.softmax(dim=-1)


def make_generator(seed: int | None, device: str | torch.device) -> torch.Generator:
    """A per-sequence generator; unseeded requests get a fresh random seed."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list on `device` without waiting for the device (`torch.tensor(..., device=cuda)`
    blocks until the stream has drained, which would undo the engine's step overlap)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
