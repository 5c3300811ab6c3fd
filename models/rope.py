"""Rotary position embeddings: frequencies (default, linear, llama3 scaling) and their application."""
from __future__ import annotations

import math

import torch

from .args import ModelArgs


def inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """The rotary inverse frequencies, float64, with the checkpoint's scaling applied."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def cos_sin_table(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, each [max_position_embeddings, head_dim // 2], float32."""
    positions = torch.arange(args.max_position_embeddings, dtype=torch.float64)
    angles = torch.outer(positions, inverse_frequencies(args))
    return angles.cos().float(), angles.sin().float()


def rope_factors(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand table rows [tokens, head_dim // 2] to the [tokens, 1, head_dim] factors apply_rope takes.

    Done once per forward pass and shared by every layer (fewer kernels in the decode graph)."""
    return (torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype),
            torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by rope_factors' cos/sin (HF's rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
