"""Batch invariance of the deterministic ops (models/invariant.py, models/kernels/
invariant_matmul.py and row_ops.py): a row's output is bit-identical alone and inside batches of many sizes with
random other rows, in float32 and bfloat16 on the torch path (CPU). The Triton kernels' bit-identity is
a property of the GPU's products, checked on a GPU (`-m gpu`); through Triton's interpreter on CPU
(float32 and float16: the interpreter has no bfloat16 product) their products are numpy's, whose
bits depend on the CPU's BLAS, so there they are checked for their values only."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from models.invariant import TILE, chunked_attention, linear, per_row, per_tile, rms_norm, tiles_agree
from engines.core.sampling import SamplingParams, filter_logits

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # as tests/models/test_kernels.py: set before triton runs a kernel
import triton  # noqa: E402, F401  (scripts/install pins it: the kernels' tests run, never skip)

DTYPES = [torch.float32, torch.bfloat16]
SIZES = [1, 3, 17, 64, 200]


def batches(g: torch.Generator, row: torch.Tensor, sizes=SIZES):
    """(batch, index of `row` in it) for each size: `row` at a random place among random rows."""
    for m in sizes:
        x = torch.randn(m, *row.shape, generator=g).to(row.dtype)
        at = int(torch.randint(0, m, (1,), generator=g))
        x[at] = row
        yield x, at


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["plain", "norm+bias", "gated+residual"])
def test_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype, variant: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 96, 160
    w = torch.randn(n, k, generator=g).to(dtype)
    kw: dict = {}
    if variant == "norm+bias":
        kw = dict(norm_weight=torch.randn(k, generator=g).to(dtype), bias=torch.randn(n, generator=g).to(dtype), eps=1e-5)
    cols = 2 * k if variant == "gated+residual" else k
    row = torch.randn(cols, generator=g).to(dtype)
    res_row = torch.randn(n, generator=g).to(dtype)

    def call(x: torch.Tensor) -> torch.Tensor:
        if variant == "gated+residual":
            return linear(x, w, gated=True, residual=res_row.expand(x.shape[0], n).contiguous())
        return linear(x, w, **kw)
    alone = call(row[None])[0]
    for x, at in batches(g, row):
        assert torch.equal(call(x)[at], alone), x.shape
    # and it is the product it claims to be
    a = F.silu(row[:k]) * row[k:] if variant == "gated+residual" else row
    if "norm_weight" in kw:
        a = F.rms_norm(a, (k,), kw["norm_weight"], 1e-5)
    want = F.linear(a.float(), w.float(), kw["bias"].float() if "bias" in kw else None)
    if variant == "gated+residual":
        want = want + res_row.float()
    torch.testing.assert_close(alone.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_blas_that_sums_by_place_is_caught_and_rows_go_one_by_one() -> None:
    """The CPU check: a product whose last rows of a tile are summed in another order (as some BLAS
    edge kernels do) fails `tiles_agree`, and `per_row` (the fallback) gives every row its bits alone."""
    def by_place(t: torch.Tensor) -> torch.Tensor:  # rows past 11 summed one by one
        return torch.stack([r.sum() if i < 12 else r.cumsum(0)[-1] for i, r in enumerate(t)])[:, None]
    assert tiles_agree(lambda t: t @ torch.ones(t.shape[1], 1), 64, torch.float32)
    assert not tiles_agree(by_place, 64, torch.float32)
    g = torch.Generator().manual_seed(7)
    row = torch.randn(64, generator=g)
    while row.sum() == row.cumsum(0)[-1]:  # a row whose two sums differ
        row = torch.randn(64, generator=g)
    alone = by_place(row[None])[0]
    for x, at in batches(g, row):
        assert torch.equal(per_row(by_place, x)[at], alone)
    x = torch.randn(TILE, 64, generator=g)
    x[13] = row
    assert not torch.equal(per_tile(by_place, x)[13], alone)  # (what the check caught)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    weight, row = torch.randn(64, generator=g).to(dtype), torch.randn(64, generator=g).to(dtype)
    alone = rms_norm(row[None], weight, 1e-5)[0]
    for x, at in batches(g, row):
        assert torch.equal(rms_norm(x, weight, 1e-5)[at], alone)


def paged(g: torch.Generator, dtype: torch.dtype, lengths: list[int], heads=4, kv_heads=2, d=16, bs=8):
    """A cache holding `lengths` tokens for each sequence, and its block tables."""
    per_seq = -(-max(lengths) // bs)
    blocks = len(lengths) * per_seq + 1
    cache = torch.randn(2, blocks, bs, kv_heads, d, generator=g).to(dtype)
    tables = (torch.randperm(blocks - 1, generator=g)[:len(lengths) * per_seq] + 1).view(len(lengths), per_seq)
    return cache, tables


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_position_is_the_same_in_decode_prefill_and_chunks(dtype: torch.dtype) -> None:
    """A query row's output: computed in one prefill, in prefill chunks of several sizes, as a
    decode row, and packed beside other sequences (decode rows and chunks) — the same bits."""
    g = torch.Generator().manual_seed(3)
    length, heads = 150, 4
    cache, tables = paged(g, dtype, [length, 90, 200])
    q = torch.randn(length, heads, 16, generator=g).to(dtype)
    whole = chunked_attention(q, cache[0], cache[1], [length], [length], tables[:1])
    for chunk in (1, 7, 37, 64):
        parts = [chunked_attention(q[s:s + chunk], cache[0], cache[1], [min(chunk, length - s)],
                                   [min(s + chunk, length)], tables[:1]) for s in range(0, length, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    others = torch.randn(1 + 30, heads, 16, generator=g).to(dtype)
    for p in (0, 63, 64, 149):
        mixed = torch.cat([others[:1], q[p:p + 1], others[1:]])
        got = chunked_attention(mixed, cache[0], cache[1], [1, 1, 30], [90, p + 1, 200], tables[[1, 0, 2]])
        assert torch.equal(got[1], whole[p]), p


def test_top_p_filter_of_a_row_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    row = torch.randn(512, generator=g)
    alone = filter_logits(row[None], [params])[0]
    for x, at in batches(g, row, [2, 17, 64]):
        assert torch.equal(filter_logits(x, [params] * x.shape[0])[at], alone)


# ---- the Triton kernel (natively on a GPU, else through the interpreter) --------------------------
DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("variant", ["plain", "norm+bias", "gated+residual"])
def test_invariant_kernels_compute_their_product_through_every_tile(dtype: torch.dtype, variant: str) -> None:
    """The Triton path of `linear` (models/kernels/row_ops.py, then the product), through each tile:
    the product it claims, alone and in batches of 3 and 70 rows (interpreter or GPU)."""
    from models.kernels.invariant_matmul import LARGE, MEDIUM, SMALL
    case = _kernel_case(dtype, variant)
    for tiles in (SMALL, MEDIUM, LARGE):
        case.close_to_reference(case.call(case.row[None], tiles)[0])
        for x, at in batches(case.g, case.row.cpu(), [3, 70]):
            case.close_to_reference(case.call(x.to(DEV), tiles)[at])


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="the products' bits are the GPU's (on CPU the interpreter's are numpy's)")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("variant", ["plain", "norm+bias", "gated+residual"])
def test_invariant_kernels_rows_do_not_depend_on_the_batch_or_the_tile(dtype: torch.dtype, variant: str) -> None:
    """A row alone and in batches of 3 and 70 rows, through each tile and through the tile chosen by
    the rows (SMALL alone and for 3, MEDIUM for 70): the same bits."""
    from models.kernels.invariant_matmul import LARGE, MEDIUM, SMALL
    case = _kernel_case(dtype, variant)
    by_tile = {}
    for tiles in (SMALL, MEDIUM, LARGE, None):
        alone = by_tile[tiles] = case.call(case.row[None], tiles)[0]
        for x, at in batches(case.g, case.row.cpu(), [3, 70]):
            assert torch.equal(case.call(x.to(DEV), tiles)[at], alone), (x.shape, tiles)
    assert torch.equal(by_tile[SMALL], by_tile[MEDIUM]) and torch.equal(by_tile[SMALL], by_tile[LARGE])
    case.close_to_reference(by_tile[SMALL])


class _kernel_case:
    """One product of the invariant kernels: weights, a row, the call, and its float32 reference."""

    def __init__(self, dtype: torch.dtype, variant: str) -> None:
        self.g = torch.Generator().manual_seed(5)
        n, k = 200, 600
        rnd = lambda *size: torch.randn(*size, generator=self.g).to(DEV, dtype)  # noqa: E731
        self.w = rnd(n, k)
        self.gated, self.normed = variant == "gated+residual", variant == "norm+bias"
        self.norm_w, self.bias = (rnd(k), rnd(n)) if self.normed else (None, None)
        self.row, self.res_row = rnd(2 * k if self.gated else k), rnd(n)
        a = self.row.float()
        if self.gated:
            a = F.silu(a[:k]) * a[k:]
        if self.normed:
            a = a * torch.rsqrt(a.pow(2).mean() + 1e-5) * self.norm_w.float()
        self.want = self.w.float() @ a + (self.bias.float() if self.normed else 0) + (self.res_row.float() if self.gated else 0)

    def call(self, x: torch.Tensor, tiles) -> torch.Tensor:  # noqa: ANN001
        from models.kernels.invariant_matmul import invariant_matmul
        from models.kernels.row_ops import rms_norm_rows, silu_mul_rows
        if self.gated:
            x = silu_mul_rows(x)
        if self.normed:
            x = rms_norm_rows(x, self.norm_w, 1e-5)
        residual = self.res_row.expand(x.shape[0], self.w.shape[0]).contiguous() if self.gated else None
        return invariant_matmul(x, self.w, bias=self.bias, residual=residual, tiles=tiles)

    def close_to_reference(self, got: torch.Tensor) -> None:
        torch.testing.assert_close(got.float(), self.want, rtol=0, atol=0.02 * self.want.abs().max().item())


def test_the_products_tiles_check_says_whether_they_agree() -> None:
    """check_tiles records its verdict per device, and tiles_for follows it: LARGE for every call
    where the tiles disagree (here forced by a verdict of False), SMALL for few rows where they agree."""
    from models.kernels import invariant_matmul as im
    dev = torch.device(DEV, 0) if DEV == "cuda" else torch.device("cpu")
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(9)).to(dev, KERNEL_DTYPES[0])
    try:
        verdict = im.check_tiles([w], rows=im.SMALL_ROWS + 8)
        assert im._tiles_by_rows[dev] is verdict
        assert im.tiles_for(1, 48, dev) == (im.SMALL if verdict else im.LARGE)
        if DEV == "cuda":
            assert verdict, "SMALL and LARGE give other bits on this GPU: deterministic decode takes the slow tile"
        im._tiles_by_rows[dev] = False
        assert im.tiles_for(1, 48, dev) == im.tiles_for(1, 32000, dev) == im.tiles_for(2048, 48, dev) == im.LARGE
    finally:
        im._tiles_by_rows.pop(dev, None)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="the kernel's bits are the GPU's (on CPU the interpreter's products are numpy's)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_kernel_deterministic_decode_row_equals_its_prefill_row(dtype: torch.dtype) -> None:
    """The Triton kernel as deterministic engines run it (decode's query tile for every row, every
    row's keys in the same splits merged in order): a position's output as a
    decode row (alone, and beside a long decode row and a chunk; split over programs past 128 keys)
    is the bit pattern of its row in a whole prefill and in chunks; `check_query_tiles`, which
    engines run at start, agrees."""
    from models.kernels.paged_attention import BLOCK_KEYS, check_query_tiles, paged_attention, query_block
    from models.paged import query_blocks
    assert check_query_tiles(4, 2, 16, dtype, torch.device(DEV))
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, d, length = 4, 2, 16, 300  # longer than a default split (256 keys)
    cache, tables = paged(g, dtype, [length, 280, 120], heads, kv_heads, d, bs=16)
    cache, tables = cache.to(DEV), tables.to(DEV)
    q = torch.randn(length, heads, d, generator=g).to(DEV, dtype)
    t = lambda v: torch.tensor(v, device=DEV)  # noqa: E731

    def run(rows: torch.Tensor, q_lens: list[int], seq_lens: list[int], order: list[int]) -> torch.Tensor:
        bq = query_block(heads, kv_heads, max(q_lens) == 1, deterministic=True)
        cu_qb = query_blocks(q_lens, bq)
        return paged_attention(rows, cache[0], cache[1], t([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
                               t(seq_lens), tables[order], t(cu_qb), cu_qb[-1], bq, min_split_keys=BLOCK_KEYS,
                               merge_splits=True)
    whole = run(q, [length], [length], [0])
    chunked = torch.cat([run(q[s:s + 100], [100], [s + 100], [0]) for s in range(0, length, 100)])
    assert torch.equal(chunked, whole)
    other = torch.randn(2, heads, d, generator=g).to(DEV, dtype)
    for p in (0, 127, 128, 200, 299):
        assert torch.equal(run(q[p:p + 1], [1], [p + 1], [0])[0], whole[p]), p
        mixed = run(torch.cat([other[:1], q[p:p + 1], other[1:]]), [1, 1, 1], [280, p + 1, 120], [1, 0, 2])
        assert torch.equal(mixed[1], whole[p]), p


def test_paged_attention_kernel_deterministic_mode_computes_attention() -> None:
    """The kernel as deterministic engines run it (every row's keys in fixed splits, merged in
    order), a prefill beside decode rows: attention's values (interpreter or GPU; the bits are the
    GPU test's above)."""
    from models.kernels.paged_attention import BLOCK_KEYS, paged_attention, query_block
    from models.paged import packed_meta, reference_paged_attention
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, d, bs = 4, 2, 16, 16
    cache, tables = paged(g, torch.float16, [300, 280], heads, kv_heads, d, bs=bs)
    cache = cache.to(DEV)
    work = [(tables[0].tolist(), 200, 100), (tables[1].tolist(), 279, 1)]
    q = torch.randn(101, heads, d, generator=g).to(DEV, torch.float16)
    bq = query_block(heads, kv_heads, False, deterministic=True)
    meta = packed_meta(work, bs, tables.shape[1], bq, DEV)
    got = paged_attention(q, cache[0], cache[1], meta.cu_q, meta.seq_lens, meta.block_tables, meta.cu_qblocks,
                          meta.num_programs, bq, min_split_keys=BLOCK_KEYS, merge_splits=True)
    want = reference_paged_attention(q.float(), cache[0].float(), cache[1].float(), meta)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-3)
