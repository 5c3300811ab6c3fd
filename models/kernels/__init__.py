"""Triton kernels (CUDA; imported only where they run, and by the spawn server), among them:

- `gemv.fused_gemv`: matrix-vector product with RMSNorm / silu-gate prologue and bias / residual epilogue.
- `attention.decode_attention`: rotary + KV-cache write + GQA decode attention in one kernel.
- `fp8`: FP8 products with activations quantized at run time; `moe`: the fused experts' step.
"""


def preload() -> None:
    """Import the kernels and what Triton imports at a process's first launch, and compute what it
    hashes once per process (its own sources, ~0.3 s, and each kernel's source), without touching
    CUDA: the spawn server calls this before it forks engines, so a restarted engine skips it."""
    from models.kernels import attention, fp8, gemv, invariant_matmul, moe, paged_attention, rope_cache, row_ops

    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # older Triton
        from triton.compiler.compiler import triton_key
    triton_key()
    try:  # (Triton 3.5+ imports it at a process's first launch; the H200 profile of restarts showed
        import triton.experimental.gluon.language  # noqa: F401  its sources compiled there each time)
    except ImportError:
        pass
    for module in (attention, fp8, gemv, invariant_matmul, moe, paged_attention, rope_cache, row_ops):
        for kernel in vars(module).values():
            if type(kernel).__name__ == "JITFunction":
                getattr(kernel, "cache_key", None)  # a cached property (none in interpreter mode)
