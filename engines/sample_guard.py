"""Sampling that fails a request, never the engine.

``guarded_sample`` wraps the batched Sampler for the scheduler loop:
- rows whose logits are not all finite (NaN/inf: broken weights or activations) are flagged on the
  device, with no host sync (the flags travel with the tokens in InFlight and are read back with
  them); their token is replaced by 0 so the next decode step reads a valid id;
- NaN rows would make ``torch.multinomial`` raise for the whole batch, so the sampler sees their
  logits zeroed (a harmless uniform draw that is then discarded);
- if the sampler still raises (any other sampling error), each row is sampled alone and only the
  rows that raise are flagged, with the error's text.
A flagged row's sequence ends with ``finish_reason="error"`` (Sequence.fail); the server answers
that request with an OpenAI-style 500 (or an SSE error event), everything else keeps running.
"""
from __future__ import annotations

import logging

import torch

from .sampling import Sampler, SamplingParams

log = logging.getLogger("engines.sampling")

NONFINITE = "non-finite logits (NaN or inf): the model's weights or activations are broken"


def guarded_sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
                   positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, dict[int, str]]:
    """(tokens [B], finite [B] bool, {row: error} for rows whose sampling raised), on the logits' device."""
    finite = torch.isfinite(logits).all(dim=-1)
    safe = logits if all(p.greedy for p in params) else torch.where(  # argmax never raises on NaN
        finite.unsqueeze(1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
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
    tokens = torch.where(finite, tokens, torch.zeros_like(tokens))
    return tokens, finite, errors
