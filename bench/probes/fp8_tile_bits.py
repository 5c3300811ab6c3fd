"""Issue 54: why per-tensor FP8's CUDA-graph tokens leave its eager ones (tests/models/test_fp8_moe_gpu.py).

Hypothesis: an eager prefill of 16 rows takes the product's 16-row tile (mma.sync on Hopper) while the
graph pads it to the 64-row mixed graph, whose 64-row tile runs wgmma; FP8 wgmma chains its K steps
inside the tensor core in less than float32 precision, mma.sync adds them in float32 registers. With
one K block of 128 (per-tensor, and block-wise 128x128 checkpoints) that chain is 4 steps of 32, so a
row's bits depend on its tile; with the tiny preset's 32-wide blocks a K block is one step, and its
graph tokens equal eager ones. The probe multiplies the same 16 rows alone (16-row tile) and inside
64 rows (64-row tiles), for each layout, with the product's own K block and with K blocks of 32, and
says whether the 16 rows' bits are equal. On CPU (Triton's interpreter) every tile gives the same
bits: only a GPU answers.

    python3 bench/probes/fp8_tile_bits.py
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from models.kernels.fp8 import _fp8_matmul, quantize_rows  # noqa: E402

CASES = {  # label: (K, N, weight scale rows, weight scale cols or None for K, activation group or None for K)
    "per-tensor K=64 (tiny)": (64, 192, 1, None, None),
    "per-tensor K=2048": (2048, 2048, 1, None, None),
    "block 32 K=64 (tiny)": (64, 192, 32, 32, 32),
    "block 128 K=2048": (2048, 2048, 128, 128, 128),
}
TILES = {16: (16, 64, 4, 5), 64: (64, 64, 4, 4)}  # models/kernels/fp8.py `tiles` by row count


def product(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, scale_rows: int,
            scale_cols: int, group: int, tile: tuple[int, int, int, int], bk: int) -> torch.Tensor:
    """`fp8_matmul` with a chosen tile and K block."""
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=xq.device)
    bm, bn, warps, stages = tile
    _fp8_matmul[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        xq, xs, w, ws, out, out, m, n, k, xq.stride(0), w.stride(0), out.stride(0), xs.stride(0), xs.stride(1),
        ws.stride(0), ws.stride(1), A_GROUP=group, W_ROWS=scale_rows, W_COLS=scale_cols, HAS_BIAS=False,
        BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    print(f"{'layout':<24} {'BK':>4}  16 rows alone vs inside 64: equal bits, max |diff| / max |y|")
    for label, (k, n, sr, sc, group) in CASES.items():
        sc, group = sc or k, group or k
        x = torch.randn(64, k, generator=g).to(dev, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / 8).to(dev).to(torch.float8_e4m3fn)
        ws = (torch.rand(n // sr, k // sc, generator=g) + 0.5).to(dev)
        xq, xs = quantize_rows(x, group)
        own_bk = min(128, sc, group) if min(sc, group) < k else 128
        for bk in sorted({own_bk, 32}, reverse=True):
            alone = product(xq[:16], xs[:16], w, ws, sr, sc, group, TILES[16], bk)
            inside = product(xq, xs, w, ws, sr, sc, group, TILES[64], bk)[:16]
            diff = ((alone - inside).abs().max() / alone.abs().max()).item()
            print(f"{label:<24} {bk:>4}  {bool(torch.equal(alone, inside))!s:<5} {diff:.2e}"
                  f"{'  (the product own K block)' if bk == own_bk else ''}")


if __name__ == "__main__":
    main()
