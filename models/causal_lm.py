"""CausalLM: the decoder (models/decoder.py) with the forward a step takes: batch-invariant
in a deterministic engine, the fused batch-1 kernels for a small decode step, else the eager one."""
from __future__ import annotations

import torch

from .decoder import Decoder
from .fused_decode import FUSED_MAX_BATCH, fused_decode
from .invariant_forward import invariant_forward
from .paged import AttnMeta


class CausalLM(Decoder):
    """What the engine runs: `deterministic` and `use_fused_decode` choose the forward path."""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        if self.deterministic:
            return invariant_forward(self, input_ids, positions, meta)
        if meta.decode_only and self.use_fused_decode and input_ids.shape[0] <= FUSED_MAX_BATCH:
            return fused_decode(self, input_ids, positions, meta)
        return super().forward(input_ids, positions, meta)
