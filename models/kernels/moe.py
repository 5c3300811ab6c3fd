"""The Mixture-of-Experts step on the GPU: tokens routed and grouped by expert, then two grouped products.

0. `route_tokens`: each token's softmax over the experts and its top k, one launch (torch: five).
1. `group_by_expert`: every (token, choice) row in order of its expert, each expert's rows padded to
   whole blocks of BM, with the expert of each block (-1: a block past the last). Two Triton
   launches of fixed shapes (it was ~25 torch ops: 0.44 ms of host time per MoE layer in a graph's
   capture, bench/RESULTS.md), so a decode step is captured in a CUDA graph like any other.
2. `_gate_up`: per block, its rows' tokens times the block's expert's gate and up weights, with
   silu(gate) * up fused: the intermediate `[T * k, I]`.
3. `_down`: per block, the intermediate times the expert's down weight, times the row's routing
   weight: `[T * k, H]` in float32; the k choices of a token are summed in order (no atomics: the
   same bits on every run).
bf16 experts, or FP8 block-wise ones (activations quantized per token and group of bk first, each
product's scales applied at every K block, as models/kernels/fp8.py does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def block_rows(rows: int, experts: int) -> int:
    """Rows per block: small while each expert gets few rows (decode), larger for prefill."""
    per_expert = rows / experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


@triton.jit
def _route(logits_ptr, weights_ptr, ids_ptr, E, stride, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
           RENORM: tl.constexpr):
    """Program t: token t's softmax over the experts in float32, its top K (largest first, a tie to the
    lower id), renormalised to sum to 1 if RENORM."""
    t = tl.program_id(0)
    e = tl.arange(0, EP)
    x = tl.load(logits_ptr + t * stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    slot = tl.arange(0, KP)
    weights = tl.zeros((KP,), tl.float32)
    ids = tl.zeros((KP,), tl.int64)
    for j in tl.static_range(K):
        best = tl.argmax(p, 0)
        weights = tl.where(slot == j, tl.max(p, 0), weights)
        ids = tl.where(slot == j, best.to(tl.int64), ids)
        p = tl.where(e == best, -1.0, p)
    if RENORM:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + t * K + slot, weights, mask=slot < K)
    tl.store(ids_ptr + t * K + slot, ids, mask=slot < K)


def route_tokens(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """models.moe.route in one launch: (weights float32 `[T, k]`, expert ids int64 `[T, k]`)."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route[(t,)](logits, weights, ids, e, logits.stride(0), K=top_k, KP=triton.next_power_of_2(top_k),
                     EP=triton.next_power_of_2(e), RENORM=renormalize, num_warps=1)
    return weights, ids


GROUP_CHUNK = 128  # (token, choice) rows a program of the grouping places
GROUP_BLOCKS = 64  # blocks a program of the grouping labels


@triton.jit(do_not_specialize=["n"])
def _count_experts(ids_ptr, counts_ptr, n, EP: tl.constexpr, CHUNK: tl.constexpr):
    """Program c: how many of the rows c * CHUNK.. go to each expert, `counts[c, :]`."""
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + i, mask=i < n, other=EP).to(tl.int32)
    bins = tl.arange(0, EP)
    tl.store(counts_ptr + c * EP + bins, tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["n", "chunks", "blocks"])
def _place_rows(ids_ptr, counts_ptr, rows_ptr, block_expert_ptr, n, chunks, blocks, E,
                EP: tl.constexpr, CHUNK: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, TILE: tl.constexpr):
    """Program c: the rows c * CHUNK.. to their places (an expert's rows in their order, from its
    padded start), and the blocks c * NB..: their expert (-1: past the last) and padding rows (n)."""
    c = tl.program_id(0)
    bins = tl.arange(0, EP)
    total = tl.zeros((EP,), tl.int32)
    before = tl.zeros((EP,), tl.int32)  # each expert's rows in the chunks before this one
    for c0 in range(0, chunks, TILE):
        at = c0 + tl.arange(0, TILE)
        counts = tl.load(counts_ptr + at[:, None] * EP + bins[None, :], mask=(at < chunks)[:, None], other=0)
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((at < c)[:, None], counts, 0), axis=0)
    padded = (total + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)  # (the experts past E: none; their ends are the last)
    starts = ends - padded
    if c < chunks:
        local = tl.arange(0, CHUNK)
        i = c * CHUNK + local
        e = tl.load(ids_ptr + i, mask=i < n, other=EP).to(tl.int32)
        rank = tl.sum(((e[:, None] == e[None, :]) & (local[None, :] < local[:, None])).to(tl.int32), axis=1)
        base = tl.sum(tl.where(e[:, None] == bins[None, :], (starts + before)[None, :], 0), axis=1)
        tl.store(rows_ptr + base + rank, i, mask=i < n)
    b = c * NB + tl.arange(0, NB)
    first = b * BM
    expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)  # E or more: past the last
    real_end = tl.sum(tl.where(expert[:, None] == bins[None, :], (starts + total)[None, :], 0), axis=1)
    tl.store(block_expert_ptr + b, tl.where(expert < E, expert, -1), mask=b < blocks)
    pos = first[:, None] + tl.arange(0, BM)[None, :]
    tl.store(rows_ptr + pos, n, mask=(b < blocks)[:, None] & (pos >= real_end[:, None]))


def group_by_expert(ids: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows `[P]` int32: the (token * k + choice) rows in order of their expert (each expert's in their
    own order), each expert's padded to a multiple of `bm` with T * k; block_expert `[P / bm]` int32,
    -1 past the last block). Two launches whatever the expert count: per chunk of rows, its count for
    each expert; then each row to its place, and each block labelled."""
    flat = ids.reshape(-1)
    n = flat.numel()
    total = -(-(n + min(experts, n) * (bm - 1)) // bm) * bm  # every expert's padding at most bm - 1
    blocks = total // bm
    rows = torch.empty(total, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    if n:
        ep, chunks = max(16, triton.next_power_of_2(experts)), triton.cdiv(n, GROUP_CHUNK)
        counts = torch.empty(chunks, ep, dtype=torch.int32, device=ids.device)
        _count_experts[(chunks,)](flat, counts, n, EP=ep, CHUNK=GROUP_CHUNK, num_warps=8)
        _place_rows[(max(chunks, triton.cdiv(blocks, GROUP_BLOCKS)),)](
            flat, counts, rows, block_expert, n, chunks, blocks, experts,
            EP=ep, CHUNK=GROUP_CHUNK, BM=bm, NB=GROUP_BLOCKS, TILE=32, num_warps=8)  # (tiles of 16k)
    return rows, block_expert


@triton.jit
def _block(rows_ptr, block_expert_ptr, n_rows, BM: tl.constexpr):
    """This program's block: its expert (-1: past the last), its rows, which of them are real."""
    block = tl.program_id(0)
    rows = tl.load(rows_ptr + block * BM + tl.arange(0, BM))
    return tl.load(block_expert_ptr + block), rows, rows < n_rows


@triton.jit(do_not_specialize=["n_rows"])  # one compiled kernel per block size for every batch size
def _gate_up(x_ptr, xs_ptr, w_ptr, ws_ptr, rows_ptr, block_expert_ptr, out_ptr, n_rows, K, I,
             stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
             TOP_K: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, rows, valid = _block(rows_ptr, block_expert_ptr, n_rows, BM)
    if e < 0:
        return
    pid_n = tl.program_id(1)
    tokens = rows // TOP_K
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BK)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8:
            a_s = tl.load(xs_ptr + tokens * stride_xs + k0 // SBK, mask=valid, other=0.0)
            s_base = ws_ptr + e * stride_wse + (k0 // SBK)
            g_s = tl.load(s_base + (offs_n // SBN) * stride_wsn, mask=n_ok, other=0.0)
            u_s = tl.load(s_base + ((offs_n + I) // SBN) * stride_wsn, mask=n_ok, other=0.0)
            acc_g += tl.dot(a, g) * a_s[:, None] * g_s[None, :]
            acc_u += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["n_rows"])
def _down(a_ptr, as_ptr, w_ptr, ws_ptr, route_ptr, rows_ptr, block_expert_ptr, out_ptr, n_rows, K, N,
          stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
          FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, rows, valid = _block(rows_ptr, block_expert_ptr, n_rows, BM)
    if e < 0:
        return
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8:
            a_s = tl.load(as_ptr + rows * stride_as + k0 // SBK, mask=valid, other=0.0)
            w_s = tl.load(ws_ptr + e * stride_wse + (offs_n // SBN) * stride_wsn + k0 // SBK, mask=n_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BK
        w_ptrs += BK
    acc = acc * tl.load(route_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], acc, mask=valid[:, None] & n_ok[None, :])


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  block: tuple[int, int] | None = None) -> torch.Tensor:
    """`sum_k weights[t, k] * expert_{ids[t, k]}(x[t])` for this rank's slice of the experts: `[T, H]`.
    `gate_up [E, 2I, H]`, `down [E, H, I]`; FP8 experts with their block `scales` (gate_up's, down's)."""
    t, h = x.shape
    top_k = ids.shape[1]
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    n_rows = t * top_k
    bm = block_rows(n_rows, e)
    rows, block_expert = group_by_expert(ids, e, bm)
    blocks = block_expert.numel()
    fp8 = scales is not None
    sbn, sbk = block if fp8 else (1, 1)
    bk = min(128, sbk) if fp8 else 64
    bn = 64
    if fp8:
        from .fp8 import quantize_rows
        xa, xs = quantize_rows(x, sbk)
        gu_s, d_s = scales
    else:
        xa, xs = x, x
        gu_s = d_s = x.new_empty(1, 1, 1)
    inter = torch.empty(n_rows, i, dtype=x.dtype, device=x.device)
    if blocks:
        _gate_up[(blocks, triton.cdiv(i, bn))](
            xa, xs, gate_up, gu_s, rows, block_expert, inter, n_rows, h, i,
            xa.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1),
            gu_s.stride(0), gu_s.stride(1), inter.stride(0),
            TOP_K=top_k, FP8=fp8, SBN=sbn, SBK=sbk, BM=bm, BN=bn, BK=bk, num_warps=4, num_stages=3)
    if fp8:
        ia, i_s = quantize_rows(inter, sbk)
    else:
        ia, i_s = inter, inter
    out = torch.empty(n_rows, h, dtype=torch.float32, device=x.device)  # (every row is in one block: all written)
    if blocks:
        _down[(blocks, triton.cdiv(h, bn))](
            ia, i_s, down, d_s, weights.reshape(-1).float(), rows, block_expert, out, n_rows, i, h,
            ia.stride(0), i_s.stride(0), down.stride(0), down.stride(1),
            d_s.stride(0), d_s.stride(1), out.stride(0),
            FP8=fp8, SBN=sbn, SBK=sbk, BM=bm, BN=bn, BK=bk, num_warps=4, num_stages=3)
    return out.view(t, top_k, h).sum(1).to(x.dtype)
