"""Weights that cannot serve: every floating-point tensor must hold only finite values.

Checked once per load (the daemon's arena, an engine's own disk load): one pass over the weights
on their device, one host sync per tensor (milliseconds on a GPU; about a second per 4 GB on CPU).
"""
from __future__ import annotations

import torch
from torch import nn


class NonFiniteWeightsError(ValueError):
    """The checkpoint holds NaN or inf values: serving it would give garbage or crash sampling."""


def nonfinite_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers holding NaN or inf."""
    return [name for name, t in model.state_dict(keep_vars=True).items()
            if t.is_floating_point() and t.numel() and not _finite(t)]


def _finite(t: torch.Tensor) -> bool:
    if t.dtype == torch.float8_e4m3fn:  # no inf; NaN is every exponent and mantissa bit set (isfinite has no FP8 kernel)
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return bool(torch.isfinite(t).all())


def check_finite(model: nn.Module, where: str) -> None:
    """Raise NonFiniteWeightsError naming the tensors (the first 5) and where they came from."""
    bad = nonfinite_tensors(model)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise NonFiniteWeightsError(f"{where}: {len(bad)} tensor(s) hold NaN or inf: {', '.join(bad[:5])}{more}; "
                                    "these weights cannot serve")
