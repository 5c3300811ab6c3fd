"""Sampling that fails a request, never the engine.

Every step's logits come with their greedy picks (``greedy_picks``: each row's argmax, or -1 where
the row has a non-finite logit), computed inside the captured CUDA graph of the step, so a batch of
greedy requests launches nothing more to sample. ``guarded_sample`` turns them into the tokens the
scheduler loop reads back, with no host sync:
- a row whose logits are not all finite (NaN/inf: broken weights or activations) reads back -1,
  and its token on the device is 0, so the next decode step reads a valid id;
- NaN rows would make the sampler raise for the whole batch, so it sees their logits zeroed (a
  harmless draw that is then discarded);
- if the sampler still raises (any other sampling error), each row is sampled alone and only the
  rows that raise fail, with the error's text.
A failed row's sequence ends with ``finish_reason="error"`` (Sequence.fail); the server answers
that request with an OpenAI-style 500 (or an SSE error event), everything else keeps running.
"""
from __future__ import annotations

import logging

import torch

from .sampling import Sampler, SamplingParams

log = logging.getLogger("engines.core.sampling")

NONFINITE = "non-finite logits (NaN or inf): the model's weights or activations are broken"


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """`[S]` int64: each row's argmax, or -1 where the row has a non-finite logit."""
    return torch.where(torch.isfinite(logits).all(dim=-1), logits.argmax(dim=-1), -1)


def guarded_sample(sampler: Sampler, logits: torch.Tensor, picks: torch.Tensor, params: list[SamplingParams],
                   positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, dict[int, str]]:
    """(tokens [S] for the next step's input, every one a valid id; the tokens to read back, -1
    for a failed row; {row: why} for rows whose sampling raised), on the logits' device. `picks`
    are the logits' `greedy_picks`."""
    if all(p.greedy for p in params):
        return picks.clamp(min=0), picks, {}
    finite = picks >= 0
    safe = torch.where(finite.unsqueeze(1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    errors: dict[int, str] = {}
    try:
        tokens = sampler(safe, params, positions)
    except Exception as e:  # one bad row must not take the batch (or the engine) with it
        log.warning("sampling a batch of %d failed (%s: %s); sampling its rows one by one",
                    len(params), type(e).__name__, e)
        rows = []
        for i, p in enumerate(params):
            try:
                rows.append(sampler(safe[i:i + 1], [p], [positions[i]]))
            except Exception as row_error:
                errors[i] = f"sampling failed: {type(row_error).__name__}: {row_error}"
                rows.append(torch.zeros(1, dtype=torch.long, device=logits.device))
        tokens = torch.cat(rows)
        if errors:
            ok = torch.ones_like(finite)
            ok[list(errors)] = False
            finite = finite & ok
    return torch.where(finite, tokens, 0), torch.where(finite, tokens, -1), errors
