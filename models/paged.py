"""Attention over a paged KV cache for one flat batch of variable-length rows.

A step's tokens are packed into one dimension: sequence b owns rows `cu_q[b]..cu_q[b+1]-1`, the
last `q_len` positions of its `seq_lens[b]` (decode rows have q_len 1, prefill chunks more). Its
keys and values live in the blocks `block_tables[b]` of the cache `[num_blocks, block_size,
kv_heads, head_dim]`; `slot_mapping[t]` is the flat cache row (block * block_size + offset) that
row t writes. Every query attends to exactly the positions its sequence has, up to its own.

On CUDA the Triton kernel (models/kernels/paged_attention.py) runs; elsewhere a torch reference
that loops over the sequences (CPU tests, tiny models).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    """Where a step's rows read and write the KV cache (device tensors, int64)."""

    slot_mapping: torch.Tensor  # [T]
    cu_q: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    max_q_len: int  # host: 1 for a decode-only step
    cu_qblocks: torch.Tensor | None = None  # [B + 1] running count of the kernel's query blocks
    num_programs: int = 0  # host: at least cu_qblocks[-1] (the kernel's grid)
    block_q: int = 1  # host: query tokens per kernel program
    search_steps: int = 0  # host: binary-search steps the kernel takes to find a program's sequence
    logit_rows: torch.Tensor | None = None  # [S] rows whose logits are returned (None: every row)
    q_lens_host: list[int] | None = None  # host copies for the torch reference path
    seq_lens_host: list[int] | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_q_len == 1


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store each row's key and value at its flat cache row; `cache` is `[2, blocks, block_size, kvh, d]`."""
    rows = cache.shape[1] * cache.shape[2]
    cache[0].view(rows, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    cache[1].view(rows, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttnMeta, deterministic: bool = False) -> torch.Tensor:
    """`q [T, heads, d]` against the cache (after `write_kv` of this step); returns `[T, heads, d]`.
    `deterministic`: batch-invariant (models/invariant.py): on CUDA every row's keys split
    as a decode row's and merged in order, in decode's query tile (models/kernels/paged_attention.py),
    on CPU `chunked_attention`."""
    if q.is_cuda:
        from models.kernels.paged_attention import deterministic_attention, paged_attention as kernel
        return kernel(q, cache[0], cache[1], meta.cu_q, meta.seq_lens, meta.block_tables, meta.cu_qblocks,
                      meta.num_programs, meta.block_q, meta.search_steps,
                      **(deterministic_attention(q.device) if deterministic else {}))
    if deterministic:
        from .invariant import chunked_attention
        q_lens = meta.q_lens_host if meta.q_lens_host is not None else (meta.cu_q[1:] - meta.cu_q[:-1]).tolist()
        seq_lens = meta.seq_lens_host if meta.seq_lens_host is not None else meta.seq_lens.tolist()
        return chunked_attention(q, cache[0], cache[1], q_lens, seq_lens, meta.block_tables)
    return reference_paged_attention(q, cache[0], cache[1], meta)


def query_blocks(q_lens: list[int], block_q: int) -> list[int]:
    """Running count of `block_q`-token query blocks over the sequences: `[0, ..., total]`."""
    out = [0]
    for n in q_lens:
        out.append(out[-1] + -(-n // block_q))
    return out


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttnMeta) -> torch.Tensor:
    """The same contract in plain torch, one sequence at a time."""
    block_size = k_cache.shape[1]
    q_lens = meta.q_lens_host if meta.q_lens_host is not None else (meta.cu_q[1:] - meta.cu_q[:-1]).tolist()
    seq_lens = meta.seq_lens_host if meta.seq_lens_host is not None else meta.seq_lens.tolist()
    out = torch.empty_like(q)
    start = 0
    for b, (n, length) in enumerate(zip(q_lens, seq_lens)):
        blocks = meta.block_tables[b, :-(-length // block_size)]
        keys = k_cache[blocks].flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        values = v_cache[blocks].flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)
        qb = q[start:start + n].transpose(0, 1).unsqueeze(0)
        if n == length:
            o = F.scaled_dot_product_attention(qb, keys, values, is_causal=True, enable_gqa=True)
        else:
            q_pos = torch.arange(length - n, length, device=q.device)
            mask = torch.arange(length, device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1)
            o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, enable_gqa=True)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out


def sequence_meta(block_table: list[int], start: int, n: int, block_size: int,
                  device: torch.device | str) -> AttnMeta:
    """Metadata for positions start..start+n-1 of one sequence whose blocks are `block_table`
    (tests, validation, probes); every row's logits are returned."""
    pos = torch.arange(start, start + n)
    table = torch.tensor(block_table, dtype=torch.long)
    slots = table[pos // block_size] * block_size + pos % block_size
    return AttnMeta(slot_mapping=slots.to(device), cu_q=torch.tensor([0, n], device=device),
                    seq_lens=torch.tensor([start + n], device=device), block_tables=table.view(1, -1).to(device),
                    max_q_len=n, cu_qblocks=torch.tensor([0, -(-n // 16)], device=device),
                    num_programs=-(-n // 16), block_q=16,
                    q_lens_host=[n], seq_lens_host=[start + n])


def packed_meta(work: list[tuple[list[int], int, int]], block_size: int, max_blocks: int, block_q: int,
                device: torch.device | str) -> AttnMeta:
    """Metadata for one packed step of several sequences (tests, probes): each `(block table,
    start, n)` computes positions start..start+n-1 of its sequence; every row's logits are returned."""
    q_lens = [n for _, _, n in work]
    slots, tables = [], torch.zeros(len(work), max_blocks, dtype=torch.long)
    for i, (table, start, n) in enumerate(work):
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.long)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    seq_lens = [start + n for _, start, n in work]
    cu_qb = query_blocks(q_lens, block_q)
    t = lambda v: torch.tensor(v, dtype=torch.long).to(device)  # noqa: E731
    return AttnMeta(slot_mapping=t(slots), cu_q=t(query_blocks(q_lens, 1)), seq_lens=t(seq_lens),
                    block_tables=tables.to(device), max_q_len=max(q_lens), cu_qblocks=t(cu_qb),
                    num_programs=cu_qb[-1], block_q=block_q, search_steps=max(1, len(work).bit_length()),
                    q_lens_host=q_lens, seq_lens_host=seq_lens)
