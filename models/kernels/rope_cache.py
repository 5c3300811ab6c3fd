"""Rotary embedding and the KV-cache write of one step's rows, in one Triton kernel.

Unfused, a layer spends seven small kernels on this (rotate-half's negation and concatenation,
two products and a sum, two indexed copies into the cache): ~2-3 us each, ~15% of a decode step
of the 1b preset at batch 32 on an H200 (bench/probes/step_profile.py). One program per row reads
its query and key heads once, rotates them in float32, writes the rotated queries to a new
tensor and the rotated key and the value into the cache row `slot_mapping[t]`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                       stride_t, stride_h, stride_cos, stride_qt, stride_qh, stride_slot, stride_ch,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, ROWS_PAD: tl.constexpr,
                       KV_PAD: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    dtype = q_ptr.dtype.element_ty
    h = tl.arange(0, ROWS_PAD)  # query heads, then key heads
    i = tl.arange(0, HALF)
    rows = h < HEADS + KV_HEADS
    src = qkv_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(src, mask=rows[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=rows[:, None], other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cos + i).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_cos + i).to(tl.float32)[None, :]
    lo = (x1 * c - x2 * s).to(dtype)  # x * cos + rotate_half(x) * sin, by halves
    hi = (x2 * c + x1 * s).to(dtype)
    is_q = h < HEADS
    dst = q_ptr + t * stride_qt + h[:, None] * stride_qh + i[None, :]
    tl.store(dst, lo, mask=is_q[:, None])
    tl.store(dst + HALF, hi, mask=is_q[:, None])
    slot = tl.load(slot_ptr + t)
    is_k = rows & (h >= HEADS)
    dst = k_cache_ptr + slot * stride_slot + (h - HEADS)[:, None] * stride_ch + i[None, :]
    tl.store(dst, lo, mask=is_k[:, None])
    tl.store(dst + HALF, hi, mask=is_k[:, None])
    v = tl.arange(0, KV_PAD)
    d = tl.arange(0, 2 * HALF)
    has_v = v < KV_HEADS
    values = tl.load(qkv_ptr + t * stride_t + (HEADS + KV_HEADS + v)[:, None] * stride_h + d[None, :],
                     mask=has_v[:, None])
    tl.store(v_cache_ptr + slot * stride_slot + v[:, None] * stride_ch + d[None, :], values, mask=has_v[:, None])


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                   slot_mapping: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """`qkv [T, heads + 2 * kv_heads, D]` (rows contiguous in D); `cos`/`sin` as models.rope
    `rope_factors` makes them (`[T, 1, D]`, halves equal); `cache [2, blocks, block_size, kv_heads, D]`
    contiguous. Writes each row's rotated key and its value at cache row `slot_mapping[t]`; returns
    the rotated queries `[T, heads, D]`, as `apply_rope` then `write_kv` would."""
    t, _, d = qkv.shape
    if qkv.stride(-1) != 1 or not cache.is_contiguous() or cos.stride(-1) != 1 or d % 2:
        raise ValueError("rope_and_cache needs qkv rows and the cache contiguous, and an even head_dim")
    q = torch.empty(t, heads, d, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_cache_kernel[(t,)](
        qkv, cos, sin, slot_mapping, q, cache[0], cache[1],
        qkv.stride(0), qkv.stride(1), cos.stride(0), q.stride(0), q.stride(1), cache.stride(2), cache.stride(3),
        HEADS=heads, KV_HEADS=kv_heads, ROWS_PAD=triton.next_power_of_2(heads + kv_heads),
        KV_PAD=triton.next_power_of_2(kv_heads), HALF=d // 2, num_warps=4)
    return q
