"""A batch-invariant matrix product: y = prologue(x) @ W^T (+ bias) (+ residual), in Triton.

Batch-invariant: row m of y depends only on row m of x (and W), never on how many rows the call
has or which others. cuBLAS picks its algorithm (tile, split-K, reduction order) by the shape, so
a row's bits change with the batch; here every choice that touches the arithmetic is fixed:
- one tile shape (BLOCK_M x BLOCK_N x BLOCK_K, num_warps) for every call, so every output element
  is summed by the same tensor-core instructions in the same order over K;
- the K range is cut into `splits` parts at fixed positions, a function of the weight's shape and
  the device alone (`num_splits`). Each part is summed from zero and the parts are added in order
  (p0 + p1 + ...). Small grids (decode) run the parts in separate programs (split-K, to keep every
  SM streaming W) and a second kernel adds them; large grids (prefill) run them one after the other
  inside one program. Both do the very same float operations, so a row's bits do not depend on
  which way it ran.
The prologue and epilogue are those of engines/kernels/gemv.py (RMSNorm of x, silu(gate) * up,
bias, residual), here per row: RMSNorm's factor is computed in a first pass over the row's K
columns, in fixed BLOCK_K chunks, and applied before rounding to the product's dtype.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3
MAX_SPLITS = 8
MIN_SPLIT_BLOCKS = 4  # a split covers at least this many BLOCK_K columns


@triton.jit
def _load_input(x_ptr, rm, rk, mask, stride_xm, K, rstd, norm_ptr, dtype,
                NORM: tl.constexpr, GATED: tl.constexpr):
    """Columns rk of rows rm of the product's input, rounded to `dtype`."""
    ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    a = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GATED:  # x is [gate | up]
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        a = (a * tl.sigmoid(a)).to(dtype).to(tl.float32) * up
    if NORM:
        g = tl.load(norm_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        a = a * rstd[:, None] * g[None, :]
    return a.to(dtype)


@triton.jit
def _partial(x_ptr, w_ptr, norm_ptr, rm, rn, k_start, k_stop, M, N, K, stride_xm, stride_wn, rstd, dtype,
             NORM: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """sum over k in [k_start, k_stop) of input[m, k] * W[n, k], from zero, in BLOCK_K steps."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < k_stop
        a = _load_input(x_ptr, rm, rk, (rm[:, None] < M) & in_k[None, :], stride_xm, K, rstd, norm_ptr, dtype,
                        NORM, GATED)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & in_k[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _row_rstd(x_ptr, norm_ptr, rm, M, K, stride_xm, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """RMSNorm's 1 / sqrt(mean(x^2) + eps) per row, summed in BLOCK_K chunks from column 0."""
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0).to(tl.float32)
        sq += tl.sum(a * a, axis=1)
    return tl.rsqrt(sq / K + eps)


@triton.jit
def _epilogue(total, rm, rn, M, N, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym,
              BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if BIAS:
        total += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    out = total.to(dtype)
    if RESIDUAL:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(dtype)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every batch size (M = 1 included)
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, y_ptr, part_ptr, M, N, K,
                   stride_xm, stride_wn, stride_rm, stride_ym, eps,
                   NORM: tl.constexpr, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                   SPLITS: tl.constexpr, SPLIT_K: tl.constexpr, ACROSS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = w_ptr.dtype.element_ty
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        rstd = _row_rstd(x_ptr, norm_ptr, rm, M, K, stride_xm, eps, BLOCK_M, BLOCK_K)
    if ACROSS:  # this program sums split program_id(2) only; _combine_kernel adds the splits
        s = tl.program_id(2)
        acc = _partial(x_ptr, w_ptr, norm_ptr, rm, rn, s * SPLIT_K, tl.minimum((s + 1) * SPLIT_K, K), M, N, K,
                       stride_xm, stride_wn, rstd, dtype, NORM, GATED, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        at = part_ptr + s * M * N + rm[:, None] * N + rn[None, :]
        tl.store(at, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += _partial(x_ptr, w_ptr, norm_ptr, rm, rn, s * SPLIT_K, tl.minimum((s + 1) * SPLIT_K, K), M, N, K,
                              stride_xm, stride_wn, rstd, dtype, NORM, GATED, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        _epilogue(total, rm, rn, M, N, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym, BIAS, RESIDUAL)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(part_ptr, bias_ptr, res_ptr, y_ptr, M, N, stride_rm, stride_ym,
                    BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The splits' partial sums added in split order (as the single-program path adds them)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(part_ptr + s * M * N + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
    _epilogue(total, rm, rn, M, N, bias_ptr, res_ptr, y_ptr, stride_rm, stride_ym, BIAS, RESIDUAL)


def num_splits(n: int, k: int, sm_count: int) -> tuple[int, int]:
    """(splits, columns per split) of the K range for a weight `[n, k]`: enough splits that one row
    of tiles keeps `sm_count` SMs busy, at most MAX_SPLITS, each at least MIN_SPLIT_BLOCKS blocks but the last.
    A function of the weight's shape and the device, never of the batch."""
    tiles = triton.cdiv(n, BLOCK_N)
    blocks = triton.cdiv(k, BLOCK_K)
    splits = max(1, min(triton.cdiv(sm_count, tiles), MAX_SPLITS, blocks // MIN_SPLIT_BLOCKS))
    per_split = triton.cdiv(blocks, splits) * BLOCK_K
    return triton.cdiv(k, per_split), per_split


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # Triton's interpreter (tests): a few splits, so both paths run


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                     residual: torch.Tensor | None = None, across: bool | None = None,
                     sm_count: int | None = None) -> torch.Tensor:
    """`[M, K] -> [M, N]` for a weight `[N, K]` (x `[M, 2K]` when `gated`); see the module docstring.
    `across` forces one way of running the splits (tests); by default separate programs only when
    the grid has fewer tiles than the device has SMs."""
    n, k = weight.shape
    m = x.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("invariant_matmul needs x and the weight contiguous in their last dimension")
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"invariant_matmul: x has {x.shape[1]} columns, weight {tuple(weight.shape)} (gated={gated})")
    if norm_weight is not None and gated:
        raise ValueError("invariant_matmul: norm_weight and gated do not combine")
    sms = sm_count or _sm_count(x.device)
    splits, per_split = num_splits(n, k, sms)
    grid_mn = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    if across is None:
        across = splits > 1 and grid_mn[0] * grid_mn[1] < sms
    y = torch.empty(m, n, dtype=weight.dtype, device=x.device)
    if m == 0:
        return y
    part = torch.empty(splits * m * n if across else 1, dtype=torch.float32, device=x.device)
    res = residual if residual is not None else y  # never read when its flag is off
    flags = dict(BIAS=bias is not None, RESIDUAL=residual is not None)
    bias_arg = bias if bias is not None else y
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"
    _matmul_kernel[(*grid_mn, splits if across else 1)](
        x, weight, bias_arg, norm_weight if norm_weight is not None else y, res, y, part, m, n, k,
        x.stride(0), weight.stride(0), res.stride(0), y.stride(0), eps,
        NORM=norm_weight is not None, GATED=gated, SPLITS=splits, SPLIT_K=per_split, ACROSS=across,
        PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **flags)
    if across:
        _combine_kernel[grid_mn](part, bias_arg, res, y, m, n, res.stride(0), y.stride(0), SPLITS=splits,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, **flags)
    return y
