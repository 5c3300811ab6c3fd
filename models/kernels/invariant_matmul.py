"""A batch-invariant matrix product: y = x @ W^T (+ bias) (+ residual), in Triton.

Batch-invariant: row m of y depends only on row m of x (and W), never on how many rows the call
has or which others. cuBLAS picks its algorithm by the shape (tile, split-K, reduction order), so
a row's bits change with the batch. Here every output element is one chain of `tl.dot`
accumulations over K, from column 0 up, into one float32 accumulator: K is never split, and
the tile only decides which outputs a program computes.

The tile (`Tiles`) is chosen by the call's shape (`tiles_for`): for a few rows (decode) thin tiles
that spread W over every SM (the product is bound by reading W), for many (prefill) large tiles
for the tensor cores; the table is the fastest of bench/probes/invariant_tune.py's candidates for
the 1b preset's products on an H200 (bench/RESULTS.md). That is batch-invariant only if the
tensor cores sum an output's K products in the same order whatever the tile (each k16 step one
instruction on the accumulator, in order: all 14 candidates gave the same bits there):
`check_tiles` verifies it on the GPU at hand, at engine start, on the model's weights; where it
does not hold, every call from then on takes one tile (LARGE), whatever its rows.
RMSNorm and silu(gate) * up of the input run before it (models/kernels/row_ops.py).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
import triton
import triton.language as tl

SMALL_ROWS = 64  # check_tiles compares the tiles of up to this many rows with LARGE
WIDE = 4096  # outputs above which a few rows take wider tiles (enough programs either way)


class Tiles(NamedTuple):
    """One launch configuration of the product: which outputs a program computes, and how."""
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


SMALL = Tiles(16, 16, 256, 2, 4)  # a few rows, narrow W: W streamed by many programs
SMALL_WIDE = Tiles(16, 64, 128, 4, 4)
MEDIUM = Tiles(64, 32, 128, 4, 4)
MEDIUM_WIDE = Tiles(64, 128, 64, 4, 4)
LARGE = Tiles(128, 128, 64, 8, 3)  # many rows: tensor-core bound
_tiles_by_rows: dict[torch.device, bool] = {}  # per device: check_tiles' verdict (absent: not checked, assumed)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel per tile for every batch size (M = 1 included)
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                   BIAS: tl.constexpr, RESIDUAL: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & in_k[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    out = acc.to(dtype)
    if RESIDUAL:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(dtype)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out, mask=mask)


def tiles_for(m: int, n: int, device: torch.device) -> Tiles:
    """The tile of a call of m rows and n outputs on `device` (LARGE for every call where
    check_tiles found that the tile changes a row's bits)."""
    if not _tiles_by_rows.get(device, True):
        return LARGE
    if n > WIDE:
        return SMALL_WIDE if m <= 16 else MEDIUM_WIDE if m <= 64 else LARGE
    return SMALL if m <= 32 else MEDIUM if m <= 256 else LARGE


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """`[M, K] -> [M, N]` for a weight `[N, K]`; see the module docstring. `tiles` overrides the
    choice by rows (probes, tests)."""
    n, k = weight.shape
    m = x.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("invariant_matmul needs x and the weight contiguous in their last dimension")
    if x.shape[1] != k:
        raise ValueError(f"invariant_matmul: x has {x.shape[1]} columns, weight {tuple(weight.shape)}")
    y = torch.empty(m, n, dtype=weight.dtype, device=x.device)
    if m == 0:
        return y
    t = tiles or tiles_for(m, n, x.device)
    res = residual if residual is not None else y  # never read when its flag is off
    _matmul_kernel[(triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))](
        x, weight, bias if bias is not None else y, res, y, m, n, k,
        x.stride(0), weight.stride(0), res.stride(0), y.stride(0),
        BIAS=bias is not None, RESIDUAL=residual is not None,
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages)
    return y


def check_tiles(weights: Iterable[torch.Tensor], rows: int = 4 * SMALL_ROWS) -> bool:
    """Whether every tile gives LARGE's bits on this GPU for each of `weights`: `rows` random rows
    through LARGE against their first SMALL_ROWS through each other tile. Records the verdict for
    the device (a False makes every later call take LARGE) and returns it."""
    weights = list(weights)
    device = weights[0].device
    g = torch.Generator(device=device).manual_seed(0)
    same = True
    for w in weights:
        x = torch.randn(rows, w.shape[1], generator=g, device=device).to(w.dtype)
        want = invariant_matmul(x, w, tiles=LARGE)[:SMALL_ROWS]
        for tiles in (SMALL, SMALL_WIDE, MEDIUM, MEDIUM_WIDE):
            same &= torch.equal(invariant_matmul(x[:SMALL_ROWS].contiguous(), w, tiles=tiles), want)
    _tiles_by_rows[device] = same
    return same
