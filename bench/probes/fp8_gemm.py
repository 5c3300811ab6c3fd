"""FP8 products against bf16 at the 8B shape's linears (GPU): quantize + Triton FP8 product
(models/kernels/fp8.py, block-wise 128x128) beside torch's bf16 F.linear, by row count, each timed
as 20 calls replayed from one CUDA graph (as the engine's decode runs them: no launch gaps).
Columns: quantize alone, quantize + product, quantize + cuBLAS's block-scaled product (where it runs,
models/kernels/fp8.py), each product's speed against bf16's; with --sweep, every candidate tile of the product too,
and the best per (shape, rows) (and any tile that gives other bits than the default's).
    python3 bench/probes/fp8_gemm.py [--sweep]"""
from __future__ import annotations

import itertools
import sys
import time

import torch
import torch.nn.functional as F

from models.kernels.fp8 import block_scaled_mm, cublas_block_scaled, fp8_matmul, quantize_rows, tiles
from models.make_model import quantize_fp8

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 16, 64, 256, 2048, 8192)


def graphed_us(fn, calls: int = 20, reps: int = 10) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * calls) * 1e3


def candidates(m: int) -> list[tuple[int, int, int, int]]:
    """Tiles worth timing at `m` rows: short ones for decode, (64|128) x (64..256) above."""
    if m <= 16:
        return [(16, bn, 4, s) for bn in (16, 32, 64, 128) for s in (3, 4, 5, 6)]
    rows = (32, 64) if m <= 64 else (64, 128)
    return [(bm, bn, w, s) for bm, bn, w, s in itertools.product(rows, (64, 128, 256), (4, 8), (3, 4))
            if not (bm * bn >= 128 * 256 and s > 3)]


def main() -> None:
    sweep = "--sweep" in sys.argv
    budget = time.monotonic() + float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 1e18
    cublas = cublas_block_scaled(torch.device("cuda"))
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}: cuBLAS block-scaled product "
          f"{'runs' if cublas else 'no'}")
    print(f"{'shape':8} {'M':>5} {'bf16 us':>8} {'quant us':>8} {'fp8 us':>8} {'ratio':>6} {'cublas':>8} {'ratio':>6}" +
          (f" {'best us':>8} {'ratio':>6}  best tile (BM,BN,warps,stages)" if sweep else ""), flush=True)
    weights = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        weights[name] = (w.bfloat16(), *quantize_fp8(w, (128, 128)))
    for m in ROWS:  # (rows outermost: decode's first, if the budget ends the sweep)
        for name, (n, k) in SHAPES.items():
            wb, wq, ws = weights[name]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x, 128)

            def fp8(tile=None) -> torch.Tensor:
                return fp8_matmul(*quantize_rows(x, 128), wq, ws, 128, 128, 128, torch.bfloat16, tile=tile)
            tb = graphed_us(lambda: F.linear(x, wb))
            tq = graphed_us(lambda: quantize_rows(x, 128))
            tf = graphed_us(fp8)
            tc = graphed_us(lambda: block_scaled_mm(*quantize_rows(x, 128, for_cublas=True), wq, ws, torch.bfloat16,
                                                    m)) if cublas else float("nan")
            line = f"{name:8} {m:5} {tb:8.1f} {tq:8.1f} {tf:8.1f} {tb / tf:6.2f} {tc:8.1f} {tb / tc:6.2f}"
            if sweep and time.monotonic() < budget:
                ref = fp8_matmul(xq, xs, wq, ws, 128, 128, 128, torch.float32)
                best = (graphed_us(fp8, calls=10, reps=5), tiles(m, n))
                for tile in candidates(m):
                    try:
                        got = fp8_matmul(xq, xs, wq, ws, 128, 128, 128, torch.float32, tile=tile)
                        if not torch.equal(got, ref):
                            print(f"  tile {tile} gives other bits", flush=True)
                        t = graphed_us(lambda: fp8(tile), calls=10, reps=5)
                    except Exception as exc:  # a tile that does not fit the SM's shared memory
                        print(f"  tile {tile}: {type(exc).__name__}", flush=True)
                        continue
                    best = min(best, (t, tile))
                line += f" {best[0]:8.1f} {tb / best[0]:6.2f}  {best[1]}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
