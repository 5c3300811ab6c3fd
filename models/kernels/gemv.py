"""Fused matrix-vector product for batch-1 decode: y = prologue(x) @ W^T (+ bias) (+ residual).

At batch 1 a linear only streams W once, so it is bound by memory bandwidth, and the small ops
around it (RMSNorm, silu(gate) * up, bias, the residual add) each cost a kernel launch and a pass
over memory when run apart. Here they are folded into the one pass over W:
- `norm_weight`: RMSNorm of x. Each program accumulates sum(x^2) in the same loop as its dot
  products and scales by rsqrt(mean + eps) at the end (RMSNorm is linear in x apart from that
  factor), so no program waits for a separate pass over x;
- `gated`: x is `[1, 2K]` = [gate | up]; the input is silu(gate) * up (the Llama MLP);
- `residual`: added to the rounded product (the decoder's residual stream).
Every program owns BLOCK_N rows of W and multiplies-and-sums on the CUDA cores in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fused_gemv_kernel(x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, y_ptr, N, K, stride_w, eps,
                       NORM: tl.constexpr, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(x_ptr + rk, mask=mask_k, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(x_ptr + K + rk, mask=mask_k, other=0.0).to(tl.float32)
            a = (a * tl.sigmoid(a)).to(dtype).to(tl.float32) * up
            a = a.to(dtype).to(tl.float32)  # the rounded input a separate kernel would have stored
        if NORM:
            sq += a * a
            a = a * tl.load(norm_ptr + rk, mask=mask_k, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    if NORM:
        acc = acc * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    out = acc.to(dtype)
    if RESIDUAL:
        out = (tl.load(res_ptr + rn, mask=mask_n, other=0.0).to(tl.float32) + out.to(tl.float32)).to(dtype)
    tl.store(y_ptr + rn, out, mask=mask_n)


def tile_sizes(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep of the 1b preset's linears on an H200
    (bench/probes/fused_decode_probe.py, bench/RESULTS.md): few rows per program keep every SM
    busy on a small W; a large W streams best in wide, short tiles."""
    return (8, 1024, 8) if n <= 4096 else (32, 256, 8)


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """`[1, K] -> [1, N]` for a weight `[N, K]` (x is `[1, 2K]` when `gated`); see the module docstring."""
    n, k = weight.shape
    if x.shape[0] != 1 or not x.is_contiguous() or weight.stride(-1) != 1:
        raise ValueError(f"fused_gemv takes one contiguous row and a row-major weight, got x {tuple(x.shape)}")
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"fused_gemv: x has {x.shape[1]} columns, weight {tuple(weight.shape)} (gated={gated})")
    if norm_weight is not None and gated:
        raise ValueError("fused_gemv: norm_weight and gated do not combine")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tile_sizes(n, k)
    dummy = y  # never read: its flag is off
    _fused_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy, y, n, k, weight.stride(0), eps,
        NORM=norm_weight is not None, GATED=gated, BIAS=bias is not None, RESIDUAL=residual is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y
