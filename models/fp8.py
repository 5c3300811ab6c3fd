"""FP8 linear layers (models/quant.py says which checkpoints): a sharded linear whose weight is
float8_e4m3fn with its scales beside it in the arena.

Parameters, named as the checkpoint names them so that a key is a parameter name:
- `weight [out, in]` float8_e4m3fn (this rank's shard, fused parts stacked as ShardedLinear's);
- block-wise: the scale (`weight_scale_inv`, or compressed-tensors' `weight_scale`) `[out / bn, in / bk]`;
- per-tensor or per-channel: `weight_scale [out]`, one float32 per output row: the loader spreads a
  per-tensor scale over its part's rows (so fused q/k/v keep their own scales, and per-tensor FP8 is
  shared through the daemon like any other weight); static activations: `input_scale [parts]`,
  which the load's processing sets to the largest part's (one quantization of the shared input).
Forward: on GPUs with FP8 tensor cores (sm_89+) the activations are quantized at run time and one
Triton product accumulates in float32 (models/kernels/fp8.py), or from CUBLAS_ROWS rows up, where it
runs and agrees with ours, cuBLAS's block-scaled product (128x128 blocks); elsewhere (CPU, older GPUs) the
weight is dequantized to the compute dtype first (weight-only: the tests' reference path).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import all_reduce, local_shape
from .quant import Fp8Scheme


@lru_cache(maxsize=None)
def has_fp8_cores(device: torch.device) -> bool:
    """Whether this GPU multiplies float8 natively (Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """ShardedLinear's contract (`shard_dim` 0: column parallel; 1: row parallel, summed across ranks)
    over an FP8 weight; `parts` is how many checkpoint tensors are fused into it (q/k/v: 3)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_dim: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device | str, scheme: Fp8Scheme, parts: int = 1) -> None:
        super().__init__()
        local = local_shape(in_features, out_features, shard_dim, tp_size)
        self.shard_dim, self.tp_size, self.scheme, self.out_dtype = shard_dim, tp_size, scheme, dtype
        self.weight = nn.Parameter(torch.empty(local, dtype=torch.float8_e4m3fn, device=device), requires_grad=False)
        if scheme.kind == "block":
            bn, bk = scheme.block
            if local[0] % bn or local[1] % bk:
                raise ValueError(f"a {local[0]}x{local[1]} weight shard is not whole {bn}x{bk} blocks "
                                 "(quantization_config.weight_block_size)")
            scale = torch.empty(local[0] // bn, local[1] // bk, dtype=torch.float32, device=device)
            self.scale_rows, self.scale_cols = bn, bk
        else:
            scale = torch.empty(local[0], dtype=torch.float32, device=device)
            self.scale_rows, self.scale_cols = 1, local[1]
        self.register_parameter(scheme.scale_name, nn.Parameter(scale, requires_grad=False))
        self.input_scale = (nn.Parameter(torch.empty(parts, dtype=torch.float32, device=device), requires_grad=False)
                            if scheme.activations == "static" else None)
        self.bias = (nn.Parameter(torch.empty(local[0], dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scheme.scale_name)

    @property
    def cublas_shape(self) -> bool:
        """Whether cuBLAS's block-scaled product takes this weight: 128x128 blocks, a multiple of 4 of them
        along K (its scales' alignment)."""
        return self.scheme.kind == "block" and self.scheme.block == (128, 128) and self.weight.shape[1] % 512 == 0

    @torch.no_grad()
    def process_weights(self) -> None:
        """The load's processing (run once, where the weights are loaded: the daemon): one input
        scale for the fused parts, the largest."""
        if self.input_scale is not None:
            self.input_scale.fill_(self.input_scale.max().item())

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight times its scales, `[out, in]` in `dtype`."""
        scale = self.scale.float()
        if self.scheme.kind == "block":
            scale = scale.repeat_interleave(self.scale_rows, 0).repeat_interleave(self.scale_cols, 1)
        else:
            scale = scale[:, None]
        return (self.weight.float() * scale).to(dtype)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T on this rank, before any cross-rank sum or bias."""
        if self.scheme.activations == "none" or not has_fp8_cores(x.device):
            return F.linear(x, self.dequantized(x.dtype))
        y = self._product_rows(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])

    def _product_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`product` of `x [M, K]` on FP8 tensor cores: the activations quantized here, then cuBLAS's
        block-scaled product from CUBLAS_ROWS rows where it takes this weight, else ours."""
        from models.kernels.fp8 import (CUBLAS_ROWS, block_scaled_mm, cublas_block_scaled, fp8_matmul, quantize_rows,
                                        quantize_static)
        if x.shape[0] >= CUBLAS_ROWS and self.cublas_shape and cublas_block_scaled(x.device):
            return block_scaled_mm(*quantize_rows(x, 128, for_cublas=True), self.weight, self.scale, self.out_dtype,
                                   x.shape[0])
        group = self.scale_cols if self.scheme.kind == "block" else x.shape[-1]
        xq, xs = quantize_static(x, self.input_scale) if self.scheme.activations == "static" else quantize_rows(x, group)
        return fp8_matmul(xq, xs, self.weight, self.scale.view(self.scale.shape[0], -1), self.scale_rows,
                          self.scale_cols, group, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard_dim == 0:
            y = self.product(x)
            return y if self.bias is None else y + self.bias
        y = all_reduce(self.product(x), self.tp_size)
        return y if self.bias is None else y + self.bias
