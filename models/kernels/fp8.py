"""FP8 linear layers on FP8 tensor cores (Hopper, sm_89+): activations quantized at run time, one
product with float32 accumulation and the scales fused.

`quantize_rows(x, group)`: each row's groups of `group` columns to float8_e4m3fn, one float32 scale
per (row, group) (amax / 448); `quantize_static(x, scale)`: every row with one given scale.
`fp8_matmul(xq, xs, w, ws, scale_rows, scale_cols)`: `(xq * xs) @ (w * ws)^T` where `xs[m, k //
group]` scales the activations and `ws[n // scale_rows, k // scale_cols]` the weight: block-wise
weights (DeepSeek-V3's `weight_scale_inv`) or per-row ones (one scale per output row), the scales
applied to each K block's product in float32 (bits that do not depend on the tile). (Quantizing the
activations inside the product, one launch instead of two, was measured slower at every row count on
an H100: bench/RESULTS.md.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # the largest float8_e4m3fn


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, GROUPS, stride_x, stride_q, stride_s, stride_sg, GROUP: tl.constexpr,
                   BLOCK: tl.constexpr, PER: tl.constexpr):
    row, first = tl.program_id(0), tl.program_id(1) * PER  # (PER groups of a row a program)
    groups = first + tl.arange(0, PER)
    inner = tl.arange(0, BLOCK)
    cols = groups[:, None] * GROUP + inner[None, :]
    mask = (inner[None, :] < GROUP) & (cols < K) & (groups[:, None] < GROUPS)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
    tl.store(q_ptr + row * stride_q + cols, (x / scale[:, None]).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + groups * stride_sg, scale, mask=groups < GROUPS)


@triton.jit
def _quantize_static(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row, b = tl.program_id(0), tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(x / tl.load(s_ptr), -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, group: int, for_cublas: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (float8 `[M, K]`, float32 scales `[M, ceil(K / group)]`). `for_cublas`: as cuBLAS's
    block-scaled product reads them: rows padded to a multiple of 4 (their values undefined), the
    scales column-major."""
    m, k = x.shape
    groups, rows = triton.cdiv(k, group), -(-m // 4) * 4 if for_cublas else m
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t() if for_cublas else \
        torch.empty(m, groups, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(group)
    per = max(1, min(triton.next_power_of_2(groups), 4096 // block))  # (one program: up to 4096 columns)
    if m:
        _quantize_rows[(m, triton.cdiv(groups, per))](x, q, s, k, groups, x.stride(0), q.stride(0), s.stride(0),
                                                       s.stride(1), GROUP=group, BLOCK=block, PER=per)
    return q, s


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` quantized with the one float32 `scale[0]` -> (float8 `[M, K]`, scales `[M, 1]`)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if m:
        _quantize_static[(m, triton.cdiv(k, 1024))](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=1024)
    return q, scale[:1].view(1, 1).expand(m, 1)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel per tile for every row count
def _fp8_matmul(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
                A_GROUP: tl.constexpr, W_ROWS: tl.constexpr, W_COLS: tl.constexpr,
                HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    in_group = GROUP_M * grid_n  # programs of GROUP_M row tiles share their weight tiles in L2
    first_m = (pid // in_group) * GROUP_M
    rows_here = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows_here
    pid_n = (pid % in_group) // rows_here
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN]: the weight's rows, transposed
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        # each K block's product scaled and added in float32 here, per-row scales too (FP8 tensor cores
        # accumulate inside one product in less precision, and how depends on the tile: a chained
        # accumulator made a row's bits depend on the row count, and a CUDA graph's padded rows part
        # per-tensor FP8's graph tokens from eager ones)
        a_s = tl.load(as_ptr + offs_m * stride_asm + (k0 // A_GROUP) * stride_ask, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptr + (offs_n // W_ROWS) * stride_bsn + (k0 // W_COLS) * stride_bsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BK
        b_ptrs += BK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


Tile = tuple[int, int, int, int]  # (BM, BN, warps, stages)


def tiles(m: int, n: int) -> Tile:
    """(BM, BN, warps, stages) by the row count: decode-sized products take short, wide tiles."""
    if m <= 16:
        return 16, 64, 4, 5
    if m <= 64:
        return 64, 64, 4, 4
    if m <= 128 or n <= 2048:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, scale_rows: int,
               scale_cols: int, group: int, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
               tile: Tile | None = None) -> torch.Tensor:
    """`xq [M, K]` (scales `xs [M, K / group]`) times `w [N, K]^T` (scales `ws [N / scale_rows, K /
    scale_cols]`): `[M, N]` in `out_dtype`. Block-wise when `scale_cols` < K, else per row."""
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    bk = min(128, scale_cols, group) if min(scale_cols, group) < k else 128  # (a K block under one scale)
    bm, bn, warps, stages = tile or tiles(m, n)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_matmul[grid](xq, xs, w, ws, bias if bias is not None else out, out, m, n, k,
                      xq.stride(0), w.stride(0), out.stride(0), xs.stride(0), xs.stride(1), ws.stride(0),
                      ws.stride(1), A_GROUP=group, W_ROWS=scale_rows, W_COLS=scale_cols,
                      HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


CUBLAS_ROWS = 64  # from this many rows up, cuBLAS's block-scaled product where it runs (bench/RESULTS.md)
_cublas: dict[torch.device, bool] = {}


def cublas_block_scaled(device: torch.device) -> bool:
    """Whether torch's block-scaled FP8 product (cuBLAS 12.9+, Hopper: 1x128 activation scales,
    128x128 weight scales) runs on `device` and agrees with ours (relative 1e-3) on a 128-row product.
    Decided once, outside a CUDA graph's capture (inside one, before that: no)."""
    known = _cublas.get(device)
    if known is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        known = _cublas[device] = _agrees_with_ours(device)
    return known


def _agrees_with_ours(device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(128, 512, generator=g, device=device, dtype=torch.bfloat16)
    w = (torch.randn(256, 512, generator=g, device=device) / 16).to(torch.float8_e4m3fn)
    ws = torch.rand(2, 4, generator=g, device=device) + 0.5
    want = fp8_matmul(*quantize_rows(x, 128), w, ws, 128, 128, 128, torch.float32)
    try:
        got = block_scaled_mm(*quantize_rows(x, 128, for_cublas=True), w, ws, torch.float32, 128)
    except (RuntimeError, TypeError, ValueError):  # an older torch or cuBLAS, another GPU
        return False
    return bool(((got - want).norm() / want.norm()) < 1e-3)


def block_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype,
                    rows: int) -> torch.Tensor:
    """cuBLAS's block-scaled product of `quantize_rows(x, 128, for_cublas=True)` and a 128x128-block
    weight `w [N, K]` (scales `ws [N / 128, K / 128]`): `[rows, N]` in `out_dtype`."""
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.t(), out_dtype=out_dtype)[:rows]
