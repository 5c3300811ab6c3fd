"""Triton kernels for batch-1 decode (CUDA; imported only where they run, and by the spawn server).

- `gemv.fused_gemv`: matrix-vector product with RMSNorm / silu-gate prologue and bias / residual epilogue.
- `attention.decode_attention`: rotary + KV-cache write + GQA decode attention in one kernel.
"""
