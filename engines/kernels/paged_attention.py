"""Paged attention for a flat batch of decode rows and prefill chunks, in one Triton kernel.

One program per (sequence, block of its queries, KV head). Its rows are `BLOCK_Q` query tokens
times the query heads that share the KV head (GQA, padded to a power of two), so scores and the
weighted sum of values run as tensor-core products (flash-attention style: online softmax,
probabilities rounded to the cache dtype). Keys are gathered through the sequence's block table,
only up to the last position any of its queries may see, so a sequence costs what it has, not
`max_model_len`. Programs past a sequence's last query block return at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_ROWS = 16  # tl.dot's smallest M
PREFILL_ROWS = 64
BLOCK_KEYS = 64


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr,
                            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh,
                            stride_bt, scale,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    qblock = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if qblock * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, D)
    m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = qblock * BLOCK_Q + m // GROUP_PAD  # query index inside this sequence's chunk
    head = kv_head * GROUP + m % GROUP_PAD
    valid = (qi < q_len) & (m % GROUP_PAD < GROUP)
    q_rows = (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_rows + d[None, :], mask=valid[:, None], other=0.0)
    q_pos = seq_len - q_len + qi  # absolute position of each query
    key_end = tl.minimum(seq_len, seq_len - q_len + (qblock + 1) * BLOCK_Q)  # one past the last visible key

    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D], dtype=tl.float32)
    table = bt_ptr + b * stride_bt
    for start in range(0, key_end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        in_seq = j < key_end
        block = tl.load(table + j // BLOCK_SIZE, mask=in_seq, other=0)
        rows = block * stride_kb + (j % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        keys = tl.load(k_ptr + rows[:, None] + d[None, :], mask=in_seq[:, None], other=0.0)
        s = tl.dot(q, tl.trans(keys)) * scale
        s = tl.where(in_seq[None, :] & (j[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        values = tl.load(v_ptr + rows[:, None] + d[None, :], mask=in_seq[:, None], other=0.0)
        acc = tl.dot(p.to(dtype), values, acc * alpha[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_i[:, None]).to(dtype)
    o_rows = (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_rows + d[None, :], out, mask=valid[:, None])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int) -> torch.Tensor:
    """`q [T, heads, D]`; caches `[num_blocks, block_size, kv_heads, D]` (the same strides);
    `cu_q [B+1]`, `seq_lens [B]`, `block_tables [B, max_blocks]`. Returns `[T, heads, D]`.
    `max_q_len` (host) only sizes the grid: 1 for a decode-only step."""
    t, heads, d = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    rows = PREFILL_ROWS if max_q_len > 1 else MIN_ROWS
    block_q = max(1, rows // group_pad)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_attention needs q and the caches contiguous in the head dimension, "
                         "and both caches laid out alike")
    out = torch.empty_like(q)
    b = seq_lens.shape[0]
    grid = (b, triton.cdiv(max_q_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_q, seq_lens, block_tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), d ** -0.5,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_SIZE=block_size, D=d, BLOCK_N=BLOCK_KEYS,
        num_warps=4)
    return out
