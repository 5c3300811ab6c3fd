"""Paged attention for a flat batch of decode rows and prefill chunks, in one Triton kernel.

One program per (block of one sequence's queries, KV head); program i finds its sequence by a
binary search over `cu_qblocks`, the running count of query blocks per sequence, so the grid is
one flat list of query blocks (a fixed bound for a CUDA graph, whatever the mix of decode rows and
prefill chunks; programs past the last block return at once). Its rows are `BLOCK_Q` query tokens
times the query heads that share the KV head (GQA, padded to a power of two), so scores and the
weighted sum of values run as tensor-core products (flash-attention style: online softmax,
probabilities rounded to the cache dtype). Keys are gathered through the sequence's block table,
only up to the last position any of its queries may see, so a sequence costs what it has, not
`max_model_len`.

A decode row (one query) has too little work for one program once its context is long: a program
per (sequence, KV head) walks all its keys alone (a step of 32 sequences of 1.6k tokens: 256
programs for 132 SMs). Such rows are split over the grid's third axis
(flash-decoding): each program takes `split_keys` of the keys and leaves its partial result (the
unnormalised sum, the running max and the softmax denominator) in a workspace, and a second kernel
combines the parts of each (sequence, head). Prefill rows and short contexts run whole in split 0;
the grid is fixed by `max_model_len`, so a CUDA graph holds for any mix. On an H200 (1b preset,
batch 32, 1.6k tokens of context, bench/probes/step_profile.py) a decode step went 2.22 -> 2.08 ms.

Deterministic engines need a position's output to have the same bits as a decode row, in a
prefill chunk or in a continuation's replay (issue 21). So with `merge_splits` every row takes the
same splits of the keys (at the same absolute positions), each an online softmax of its own, and
merges them in order by one formula (`_merge_weights`): inside the program for prefill rows and
short decode rows, in the combine kernel for split decode rows. The query tile does not change a
row's bits if it is the same tile: deterministic engines give prefill rows decode's
(`query_block`), so a row's sums run in the same order. `check_query_tiles` verifies both on the
GPU at hand, at engine start.

Tiles of 128 keys with a two-stage pipeline (the block-table gather of the next tile overlaps this
tile's products) came out of a tuning probe on an H200 (timed inside CUDA graphs; bench/HISTORY.md,
"Paged attention's tuning"):
at 32 sequences of 1.6k shared-prefix tokens 36.2 -> 27.8 µs a layer, at 256 sequences of 100-2048
tokens 213 -> 176 µs (bench/RESULTS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_ROWS = 16  # tl.dot's smallest M
PREFILL_ROWS = 64
BLOCK_KEYS = 128
NUM_WARPS, NUM_STAGES = 4, 2
MIN_SPLIT_KEYS = 256  # keys per split of a decode row (more when max_model_len needs over MAX_SPLITS)
MAX_SPLITS = 16
NO_SPLIT = 1 << 30  # min_split_keys of one program per row (deterministic engines where check_query_tiles failed)
_tiles_agree: dict[torch.device, bool] = {}  # per device: check_query_tiles' verdict (absent: not checked, assumed)


@triton.jit
def _attend(q, k_ptr, v_ptr, table, kv_head, stride_kb, stride_ks, stride_kh, q_pos, key_start, key_stop, scale,
            ROWS: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax of `q`'s rows over keys [key_start, key_stop) (each row up to its own position),
    tiles of BLOCK_N keys from key_start: (running max, denominator, unnormalised sum of values)."""
    dtype = q.dtype
    d = tl.arange(0, D)
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for start in range(key_start, key_stop, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        in_seq = j < key_stop
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
    return m_i, l_i, acc


@triton.jit
def _merge_weights(m, m_part):
    """Merging a split's part into the running result: (new max, the result's weight, the part's).
    The one formula of both kernels' merges, so a row merged in either has the same bits."""
    m_new = tl.maximum(m, m_part)
    return m_new, tl.exp(m - m_new), tl.exp(m_part - m_new)


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                            cu_q_ptr, seq_lens_ptr, bt_ptr, cu_qb_ptr, num_seqs,
                            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh,
                            stride_bt, scale,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                            SEARCH_STEPS: tl.constexpr, SPLIT_KEYS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            MERGE_SPLITS: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if pid >= tl.load(cu_qb_ptr + num_seqs):
        return
    # the sequence b with cu_qb[b] <= pid < cu_qb[b + 1] (sequences without queries own no block)
    lo = pid * 0
    hi = lo + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(cu_qb_ptr + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    b = lo
    qblock = pid - tl.load(cu_qb_ptr + b)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, D)
    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    m = tl.arange(0, ROWS)
    qi = qblock * BLOCK_Q + m // GROUP_PAD  # query index inside this sequence's chunk
    head = kv_head * GROUP + m % GROUP_PAD
    valid = (qi < q_len) & (m % GROUP_PAD < GROUP)
    q_rows = (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_rows + d[None, :], mask=valid[:, None], other=0.0)
    q_pos = seq_len - q_len + qi  # absolute position of each query
    key_end = tl.minimum(seq_len, seq_len - q_len + (qblock + 1) * BLOCK_Q)  # one past the last visible key
    split_row = (q_len == 1) & (seq_len > SPLIT_KEYS)  # a long decode row: this program takes one split
    key_start = tl.where(split_row, split * SPLIT_KEYS, 0)
    key_stop = tl.where(split_row, tl.minimum(key_start + SPLIT_KEYS, key_end), key_end)
    if (key_start >= key_stop) | ((split > 0) & (split_row == 0)):
        return
    table = bt_ptr + b * stride_bt
    if split_row:  # this split's part, for _combine_splits_kernel
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, table, kv_head, stride_kb, stride_ks, stride_kh, q_pos,
                                key_start, key_stop, scale, ROWS, D, BLOCK_SIZE, BLOCK_N)
        part = (b * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=valid[:, None])
        tl.store(part_m_ptr + part, m_i, mask=valid)
        tl.store(part_l_ptr + part, l_i, mask=valid)
        return
    if MERGE_SPLITS:  # the same splits as a decode row's, merged in order as _combine_splits_kernel does
        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        for split_start in range(0, key_stop, SPLIT_KEYS):
            m_s, l_s, acc_s = _attend(q, k_ptr, v_ptr, table, kv_head, stride_kb, stride_ks, stride_kh, q_pos,
                                      split_start, tl.minimum(split_start + SPLIT_KEYS, key_stop), scale,
                                      ROWS, D, BLOCK_SIZE, BLOCK_N)
            m_i, w, w_s = _merge_weights(m_i, m_s)
            l_i = l_i * w + l_s * w_s
            acc = acc * w[:, None] + acc_s * w_s[:, None]
    else:
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, table, kv_head, stride_kb, stride_ks, stride_kh, q_pos,
                                key_start, key_stop, scale, ROWS, D, BLOCK_SIZE, BLOCK_N)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_i[:, None]).to(dtype)
    o_rows = (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_rows + d[None, :], out, mask=valid[:, None])


@triton.jit
def _combine_splits_kernel(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, cu_q_ptr, seq_lens_ptr,
                           stride_ot, stride_oh, D: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """One program per (sequence, query head): the split decode row's parts, rescaled to their
    common max and summed (the split programs' online softmax, finished); MERGE_SPLITS: merged one
    by one in order instead, as the attention kernel merges the splits of the rows it finishes."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if (q_len != 1) | (seq_len <= SPLIT_KEYS):
        return
    d = tl.arange(0, D)
    used_splits = (seq_len + SPLIT_KEYS - 1) // SPLIT_KEYS
    first = (b * tl.num_programs(1) + head) * NUM_SPLITS
    if MERGE_SPLITS:
        m = tl.full([1], -1.0e30, dtype=tl.float32)
        l = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([D], dtype=tl.float32)
        for s in range(0, used_splits):
            m, w, w_s = _merge_weights(m, tl.load(part_m_ptr + first + s))
            l = l * w + tl.load(part_l_ptr + first + s) * w_s
            acc = acc * w + tl.load(part_acc_ptr + (first + s) * D + d) * w_s
        out = acc / tl.where(l == 0.0, 1.0, l)
    else:
        s = tl.arange(0, SPLITS_PAD)
        used = s < used_splits
        part = first + s
        m = tl.load(part_m_ptr + part, mask=used, other=float("-inf"))
        l = tl.load(part_l_ptr + part, mask=used, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + q_start * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def query_block(heads: int, kv_heads: int, decode_only: bool, deterministic: bool = False) -> int:
    """Query tokens per program: enough rows (tokens x padded GQA group) for a tensor-core tile,
    fewer for decode-only steps; `deterministic`: decode's for every step (the tile decides the
    order of a row's sums)."""
    rows = MIN_ROWS if decode_only or deterministic else PREFILL_ROWS
    return max(1, rows // triton.next_power_of_2(heads // kv_heads))


def split_keys(max_keys: int, min_split_keys: int = MIN_SPLIT_KEYS, block_n: int = BLOCK_KEYS) -> int:
    """Keys per split of a long decode row, for caches of `max_keys` positions per sequence: at
    least `min_split_keys`, and at most MAX_SPLITS splits (a whole number of key blocks)."""
    per_split = max(min_split_keys, -(-max_keys // MAX_SPLITS))
    return -(-per_split // block_n) * block_n


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, cu_qblocks: torch.Tensor,
                    num_programs: int, block_q: int, search_steps: int | None = None, *, block_n: int = BLOCK_KEYS,
                    min_split_keys: int = MIN_SPLIT_KEYS, num_warps: int = NUM_WARPS,
                    num_stages: int = NUM_STAGES, merge_splits: bool = False) -> torch.Tensor:
    """`q [T, heads, D]`; caches `[num_blocks, block_size, kv_heads, D]` (the same strides);
    `cu_q [B+1]`, `seq_lens [B]`, `block_tables [B, max_blocks]`; `cu_qblocks [B+1]` the running
    count of `block_q`-token query blocks per sequence, `num_programs` (host) at least its last
    value. `search_steps` (default: enough for B) is fixed per engine so the kernel compiles once.
    The keyword arguments are the kernel's tuning (see the module docstring); `merge_splits`
    gives every row the splits of a decode row's keys, merged in order (deterministic engines: see
    the module docstring). Returns `[T, heads, D]`."""
    t, heads, d = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_attention needs q and the caches contiguous in the head dimension, "
                         "and both caches laid out alike")
    out = torch.empty_like(q)
    b = seq_lens.shape[0]
    per_split = split_keys(block_tables.shape[1] * block_size, min_split_keys, block_n)
    splits = -(-block_tables.shape[1] * block_size // per_split)
    parts = b * heads * splits if splits > 1 else 1  # the workspace of split decode rows
    part_acc = torch.empty(parts * d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_l = torch.empty(parts, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(num_programs, kv_heads, splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, cu_q, seq_lens, block_tables, cu_qblocks, b,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), d ** -0.5,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=block_q, BLOCK_SIZE=block_size, D=d,
        BLOCK_N=block_n, SEARCH_STEPS=search_steps or max(1, b.bit_length()), SPLIT_KEYS=per_split,
        NUM_SPLITS=splits, MERGE_SPLITS=merge_splits, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _combine_splits_kernel[(b, heads)](
            out, part_acc, part_m, part_l, cu_q, seq_lens, out.stride(0), out.stride(1), D=d,
            SPLIT_KEYS=per_split, NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            MERGE_SPLITS=merge_splits, num_warps=1)
    return out


def deterministic_attention(device: torch.device) -> dict:
    """paged_attention's keyword arguments for a deterministic engine on `device`: every row's keys
    split as a decode row's and merged in order; one program per row (the same code for a decode
    row and a prefill row, whatever the GPU) where check_query_tiles failed."""
    split = MIN_SPLIT_KEYS if _tiles_agree.get(device, True) else NO_SPLIT
    return {"min_split_keys": split, "merge_splits": True}


def check_query_tiles(heads: int, kv_heads: int, d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a deterministic engine's decode rows (their keys split over programs and combined)
    give a position the bits of its row in a prefill (in its query tile, its splits merged inside
    the program) on this GPU: random keys, 40 positions as a prefill, each as a decode row after
    it, splits of 128 keys. Records the verdict for the device (deterministic_attention)."""
    g = torch.Generator(device=device).manual_seed(0)
    length, block_size = 300, 16
    blocks = -(-length // block_size)
    cache = torch.randn(2, blocks + 1, block_size, kv_heads, d, generator=g, device=device).to(dtype)
    q = torch.randn(length, heads, d, generator=g, device=device).to(dtype)
    table = torch.arange(1, blocks + 1, device=device)[None]
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731

    def run(rows: torch.Tensor, n: int, end: int, decode: bool) -> torch.Tensor:
        bq = query_block(heads, kv_heads, decode, deterministic=True)
        programs = -(-n // bq)
        return paged_attention(rows, cache[0], cache[1], t([0, n]), t([end]), table, t([0, programs]), programs, bq,
                               min_split_keys=BLOCK_KEYS, merge_splits=True)
    whole = run(q[length - 40:], 40, length, False)
    same = all(torch.equal(run(q[p:p + 1], 1, p + 1, True)[0], whole[p - length + 40])
               for p in range(length - 40, length))
    _tiles_agree[device] = same
    return same
