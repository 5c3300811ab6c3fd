"""Fused decode attention: rotary on q and k, the new k and v written to the paged KV cache, then
attention of each query over its sequence's cached keys (through its block table), all in one kernel.

One program per (sequence, KV head) handles the query heads that share that KV head (GQA),
padded to 16 rows so scores and the weighted sum of values run as tensor-core products
(flash-attention style: online softmax, probabilities rounded to the cache dtype). It reads only
the positions the sequence has (not the whole slot), and takes the current token's own key and
value from registers, so it never reads back what it has just written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_ROWS = 16  # tl.dot's smallest M: query heads of one KV head, padded
BLOCK_KEYS = 64


@triton.jit
def _decode_attention_kernel(qkv_ptr, cache_ptr, cos_ptr, sin_ptr, bt_ptr, pos_ptr, out_ptr,
                             stride_qkv, stride_kind, stride_row, stride_bt, stride_cos, stride_out, scale,
                             HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                             BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    table = bt_ptr + b * stride_bt
    dtype = out_ptr.dtype.element_ty
    half: tl.constexpr = D // 2
    d = tl.arange(0, D)
    partner = (d + half) % D  # rotate_half: [-x2, x1]
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + b * stride_cos + d % half)
    sin = tl.load(sin_ptr + b * stride_cos + d % half) * sign

    row = qkv_ptr + b * stride_qkv
    g = tl.arange(0, BLOCK_G)
    mask_g = (g < GROUP)[:, None]
    q_offs = (kv_head * GROUP + g)[:, None] * D
    q = tl.load(row + q_offs + d[None, :], mask=mask_g, other=0.0).to(tl.float32)
    q_pair = tl.load(row + q_offs + partner[None, :], mask=mask_g, other=0.0).to(tl.float32)
    q = (q * cos[None, :] + q_pair * sin[None, :]).to(dtype)
    k_row = row + (HEADS + kv_head) * D
    k = (tl.load(k_row + d).to(tl.float32) * cos + tl.load(k_row + partner).to(tl.float32) * sin).to(dtype)
    v = tl.load(row + (HEADS + KV_HEADS + kv_head) * D + d)

    k_cache = cache_ptr + kv_head * D
    v_cache = k_cache + stride_kind
    row = tl.load(table + pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE
    tl.store(k_cache + row * stride_row + d, k)
    tl.store(v_cache + row * stride_row + d, v)

    # The current token first: it is always attended to, so the running max starts finite.
    m_i = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale
    l_i = tl.full([BLOCK_G], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32) + v.to(tl.float32)[None, :]
    for start in range(0, pos, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        mask_j = j < pos
        rows = tl.load(table + j // BLOCK_SIZE, mask=mask_j, other=0) * BLOCK_SIZE + j % BLOCK_SIZE
        keys = tl.load(k_cache + rows[:, None] * stride_row + d[None, :], mask=mask_j[:, None], other=0.0)
        s = tl.dot(q, tl.trans(keys)) * scale
        s = tl.where(mask_j[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        values = tl.load(v_cache + rows[:, None] * stride_row + d[None, :], mask=mask_j[:, None], other=0.0)
        acc = tl.dot(p.to(dtype), values, acc * alpha[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = (acc / l_i[:, None]).to(dtype)
    tl.store(out_ptr + b * stride_out + q_offs + d[None, :], out, mask=mask_g)


def decode_attention(qkv: torch.Tensor, cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     block_tables: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """One decode step of attention for `B` sequences.

    qkv `[B, (heads + 2 kv_heads) * D]` (q, k, v before rotary); cache `[2, num_blocks, block_size,
    kv_heads, D]` (one layer; row i's k and v are written at its position `positions[i]` through
    its block table `block_tables[i]`); cos/sin `[B, D // 2]` float32 rows for `positions`.
    Returns `[B, heads * D]`.
    """
    b = qkv.shape[0]
    d = cache.shape[-1]
    group = heads // kv_heads
    if qkv.stride(-1) != 1 or not cache.is_contiguous():
        raise ValueError("decode_attention needs qkv contiguous in the head dimension and a contiguous cache")
    if group > GROUP_ROWS:
        raise ValueError(f"decode_attention takes at most {GROUP_ROWS} query heads per KV head, got {group}")
    out = torch.empty(b, heads * d, dtype=qkv.dtype, device=qkv.device)
    _decode_attention_kernel[(b, kv_heads)](
        qkv, cache, cos, sin, block_tables, positions, out, qkv.stride(0), cache.stride(0), cache.stride(2),
        block_tables.stride(0), cos.stride(0), out.stride(0), d ** -0.5,
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, BLOCK_G=GROUP_ROWS, D=d, BLOCK_N=BLOCK_KEYS,
        BLOCK_SIZE=cache.shape[2], num_warps=4)
    return out
