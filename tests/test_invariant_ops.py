"""Batch invariance of the deterministic ops (engines/models/invariant.py, engines/kernels/
invariant_matmul.py and row_ops.py): a row's output is bit-identical alone and inside batches of many sizes with
random other rows, in float32 and bfloat16 on the torch path, and on the Triton kernel through
Triton's interpreter on CPU (float32 and float16: the interpreter has no bfloat16 product)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engines.models.invariant import chunked_attention, linear, rms_norm
from engines.sampling import SamplingParams, filter_logits

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # as tests/test_kernels.py: set before triton runs a kernel

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
triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("variant", ["plain", "norm+bias", "gated+residual"])
def test_invariant_kernels_rows_do_not_depend_on_the_batch_or_the_tile(dtype: torch.dtype, variant: str) -> None:
    """The Triton path of `linear` (engines/kernels/row_ops.py, then the product): a row alone and
    in batches of 3 and 70 rows, through each tile; on a GPU also through the tile chosen by the
    rows (SMALL alone and for 3, MEDIUM for 70), which must give the same bits as each other."""
    from engines.kernels.invariant_matmul import LARGE, MEDIUM, SMALL, invariant_matmul
    from engines.kernels.row_ops import rms_norm_rows, silu_mul_rows
    g = torch.Generator().manual_seed(5)
    n, k = 200, 600
    rnd = lambda *size: torch.randn(*size, generator=g).to(DEV, dtype)  # noqa: E731
    w = rnd(n, k)
    gated, normed = variant == "gated+residual", variant == "norm+bias"
    norm_w, bias = (rnd(k), rnd(n)) if normed else (None, None)
    row, res_row = rnd(2 * k if gated else k), rnd(n)

    def call(x: torch.Tensor, tiles) -> torch.Tensor:  # noqa: ANN001
        if gated:
            x = silu_mul_rows(x)
        if normed:
            x = rms_norm_rows(x, norm_w, 1e-5)
        residual = res_row.expand(x.shape[0], n).contiguous() if gated else None
        return invariant_matmul(x, w, bias=bias, residual=residual, tiles=tiles)
    by_tile = {}
    for tiles in (SMALL, MEDIUM, LARGE, *([None] if DEV == "cuda" else [])):
        alone = by_tile[tiles] = call(row[None], tiles)[0]
        for x, at in batches(g, row.cpu(), [3, 70]):
            assert torch.equal(call(x.to(DEV), tiles)[at], alone), (x.shape, tiles)
    if DEV == "cuda":
        assert torch.equal(by_tile[SMALL], by_tile[MEDIUM]) and torch.equal(by_tile[SMALL], by_tile[LARGE])
    a = row.float()
    if gated:
        a = F.silu(a[:k]) * a[k:]
    if normed:
        a = a * torch.rsqrt(a.pow(2).mean() + 1e-5) * norm_w.float()
    want = w.float() @ a + (bias.float() if normed else 0) + (res_row.float() if gated else 0)
    got = by_tile[SMALL].float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())


def test_the_products_tiles_check_says_whether_they_agree() -> None:
    """check_tiles records its verdict per device, and tiles_for follows it: LARGE for every call
    where the tiles disagree (here forced by a verdict of False), SMALL for few rows where they agree."""
    from engines.kernels import invariant_matmul as im
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.float16])
def test_paged_attention_kernel_deterministic_decode_row_equals_its_prefill_row(dtype: torch.dtype) -> None:
    """The Triton kernel as deterministic engines run it (decode's query tile for every row, every
    row's keys in the same splits merged in order): a position's output as a
    decode row (alone, and beside a long decode row and a chunk; split over programs past 128 keys)
    is the bit pattern of its row in a whole prefill and in chunks; `check_query_tiles`, which
    engines run at start, agrees."""
    from engines.kernels.paged_attention import BLOCK_KEYS, check_query_tiles, paged_attention, query_block
    from engines.models.paged import query_blocks
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
