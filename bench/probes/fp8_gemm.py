"""FP8 products against bf16 at the 8B shape's linears (GPU): the time of quantize + Triton FP8
product (engines/kernels/fp8.py, block-wise 128x128) beside torch's bf16 F.linear, by row count.
    python3 bench/probes/fp8_gemm.py"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.kernels.fp8 import fp8_matmul, quantize_rows
from engines.models.make_model import quantize_fp8

SHAPES = {"qkv 4096->6144": (6144, 4096), "gate_up 4096->28672": (28672, 4096), "down 14336->4096": (4096, 14336)}


def timed(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


print(f"{'shape':22} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'ratio':>6} {'rel err':>8}")
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    wb = w.bfloat16()
    wq, ws = quantize_fp8(w, (128, 128))
    for m in (1, 16, 64, 128, 256, 1024, 4096):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

        def fp8() -> torch.Tensor:
            xq, xs = quantize_rows(x, 128)
            return fp8_matmul(xq, xs, wq, ws, 128, 128, 128, torch.bfloat16)
        ref = F.linear(x.float(), w)
        err = ((fp8().float() - ref).norm() / ref.norm()).item()
        tb, tf = timed(lambda: F.linear(x, wb)), timed(fp8)
        print(f"{name:22} {m:5} {tb:9.1f} {tf:9.1f} {tb / tf:6.2f} {err:8.4f}")
