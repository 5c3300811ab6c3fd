"""The inputs of the batch-invariant product (models/kernels/invariant_matmul.py), one row at a time
in Triton: RMSNorm and silu(gate) * up, rounded to the input's dtype.

Batch-invariant by construction: a row is read, reduced and written by one program whose launch
configuration depends only on the row's length, so its bits never depend on how many rows the
call has. (Folded into the product's loads they cost a pass over the row per tile of the output:
fine for one row, four to eight times cuBLAS's time for a prefill: bench/RESULTS.md.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROW = 1 << 15  # columns one program holds (RMSNorm)
SILU_BLOCK = 1024


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, M, K, stride_xm, stride_ym, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    g = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, (x * rstd * g).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(x_ptr, y_ptr, M, K, stride_xm, stride_ym, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    dtype = y_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xm + K + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, ((gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up).to(dtype),
             mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`[M, K]` -> x * rsqrt(mean(x^2) + eps) * weight per row, in float32, rounded to x's dtype."""
    m, k = x.shape
    if k > MAX_ROW or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_rows takes rows of at most {MAX_ROW} contiguous columns, got {tuple(x.shape)}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if m:
        block = triton.next_power_of_2(k)
        _rms_norm_kernel[(m,)](x, weight, y, m, k, x.stride(0), y.stride(0), eps, BLOCK=block,
                               num_warps=min(16, max(1, block // 512)))
    return y


def silu_mul_rows(x: torch.Tensor) -> torch.Tensor:
    """`[M, 2K]` = [gate | up] -> silu(gate) * up `[M, K]`, each op rounded to x's dtype (as torch rounds it)."""
    m, k2 = x.shape
    if k2 % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_mul_rows takes contiguous rows of [gate | up], got {tuple(x.shape)}")
    k = k2 // 2
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m:
        _silu_mul_kernel[(m, triton.cdiv(k, SILU_BLOCK))](x, y, m, k, x.stride(0), y.stride(0), BLOCK=SILU_BLOCK,
                                                          num_warps=4)
    return y
