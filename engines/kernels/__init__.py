"""Triton kernels for batch-1 decode (CUDA; imported only where they run, and by the spawn server).

- `gemv.fused_gemv`: matrix-vector product with RMSNorm / silu-gate prologue and bias / residual epilogue.
- `attention.decode_attention`: rotary + KV-cache write + GQA decode attention in one kernel.
"""


def preload() -> None:
    """Import the kernels and compute what Triton hashes once per process (its own sources,
    ~0.3 s, and each kernel's source) without touching CUDA: the spawn server calls this before
    it forks engines, so a restarted engine skips it."""
    from . import attention, gemv

    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # older Triton
        from triton.compiler.compiler import triton_key
    triton_key()
    for kernel in (gemv._fused_gemv_kernel, attention._decode_attention_kernel):
        getattr(kernel, "cache_key", None)  # a cached property (none in interpreter mode)
