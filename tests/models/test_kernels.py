"""The fused decode kernels (models/kernels) against plain torch: on a GPU natively, on CPU
through Triton's interpreter (needs triton installed; the test install adds it on x86-64 Linux)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Read when triton is imported and when the kernels run (so it stays set: engine subprocesses
    # of later tests inherit it, and on CPU they never run the kernels).
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from models.kernels.attention import decode_attention  # noqa: E402
from models.kernels.gemv import fused_gemv  # noqa: E402
from models.kernels.paged_attention import paged_attention, query_block, split_keys  # noqa: E402
from models import AttnMeta, build_model, read_model_args  # noqa: E402
from models.fused_decode import fused_decode  # noqa: E402
from models.paged import query_blocks, reference_paged_attention, sequence_meta  # noqa: E402
from models.rope import apply_rope, rope_factors  # noqa: E402

# `pytest -m gpu` runs them on a GPU (natively, bfloat16 too); without one they still run, in Triton's
# interpreter: marked gpu, never skipped.
pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter has no bfloat16 tensor-core product; the attention kernel uses one.
DOT_DTYPES = [torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.float16]


def reference_gemv(x, w, bias=None, norm_weight=None, eps=1e-5, gated=False, residual=None):  # noqa: ANN001, ANN201
    """The unfused ops in float32, rounded where the kernel rounds: the gated input, the product,
    the residual sum (the normalised input stays float32: the kernel scales after the sum)."""
    dt, a = x.dtype, x.float()
    if gated:
        gate, up = a.chunk(2, dim=-1)
        a = (F.silu(gate).to(dt).float() * up).to(dt).float()
    if norm_weight is not None:
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = a @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(dt)
    return y if residual is None else (residual.float() + y.float()).to(dt)


@pytest.mark.parametrize("variant", ["plain", "norm+bias", "gated+residual"])
@pytest.mark.parametrize("shape", [(40, 72), (24, 2100)])  # ragged tiles; K over one tile
def test_fused_gemv_matches_the_unfused_ops(variant: str, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[1])
    (n, k), dt = shape, torch.bfloat16
    rnd = lambda *size: torch.randn(*size, generator=g).to(DEV, dt)  # noqa: E731
    w = rnd(n, k)
    kw: dict = {}
    if variant == "norm+bias":
        kw = dict(norm_weight=rnd(k), bias=rnd(n), eps=1e-5)
    if variant == "gated+residual":
        kw = dict(gated=True, residual=rnd(1, n))
    x = rnd(1, 2 * k if kw.get("gated") else k)
    got, want = fused_gemv(x, w, **kw), reference_gemv(x, w, **kw)
    # Float32 summation order, then one rounding: within two bf16 ulps of the output's scale.
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.016 * want.abs().max().item())


def test_fused_gemv_refuses_bad_shapes() -> None:
    w = torch.zeros(8, 16, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one contiguous row"):
        fused_gemv(torch.zeros(2, 16, device=DEV, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="x has 16 columns"):
        fused_gemv(torch.zeros(1, 16, device=DEV, dtype=torch.bfloat16), w, gated=True)


def shuffled_tables(g: torch.Generator, seqs: int, per_seq: int, num_blocks: int) -> torch.Tensor:
    """Distinct blocks for every sequence, in random order (block 0, the padding block, unused)."""
    return (torch.randperm(num_blocks - 1, generator=g)[:seqs * per_seq] + 1).view(seqs, per_seq)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_decode_attention_matches_rope_then_sdpa_and_writes_only_its_rows(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, bs, num_blocks = 6, 2, 32, 16, 40
    positions = torch.tensor([0, 70, 131])  # empty history, and histories across key blocks
    b = len(positions)
    tables = shuffled_tables(g, b, 9, num_blocks)
    qkv = torch.randn(b, (heads + 2 * kv_heads) * d, generator=g).to(DEV, dtype)
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).to(DEV, dtype)
    angles = positions.double()[:, None] / (10000 ** (torch.arange(0, d, 2).double() / d))
    cos, sin = angles.cos().float().to(DEV), angles.sin().float().to(DEV)

    expect_cache = cache.clone()
    got_cache = cache.clone()
    got = decode_attention(qkv, got_cache, cos, sin, tables.to(DEV), positions.to(DEV), heads, kv_heads)

    c, s = rope_factors(cos, sin, dtype)
    q_k = apply_rope(qkv.view(b, -1, d)[:, :heads + kv_heads], c, s)
    q, k, v = q_k[:, :heads], q_k[:, heads:], qkv.view(b, -1, d)[:, heads + kv_heads:]
    written = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for i in range(b):
        pos = int(positions[i])
        blk, off = int(tables[i, pos // bs]), pos % bs
        expect_cache[0, blk, off], expect_cache[1, blk, off] = k[i], v[i]
        written[blk, off] = True
        rows = tables[i, :pos // bs + 1].to(DEV)
        keys = expect_cache[0, rows].flatten(0, 1)[:pos + 1].transpose(0, 1).unsqueeze(0).float()
        values = expect_cache[1, rows].flatten(0, 1)[:pos + 1].transpose(0, 1).unsqueeze(0).float()
        want = F.scaled_dot_product_attention(q[i].unsqueeze(0).unsqueeze(2).float(), keys, values, enable_gqa=True)
        torch.testing.assert_close(got[i].view(heads, d).float(), want[0, :, 0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_cache.float(), expect_cache.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(got_cache[:, ~written.to(DEV)], cache[:, ~written.to(DEV)])


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (6, 1)])
def test_paged_attention_kernel_matches_the_reference(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    """Decode rows, a whole prompt, and prefill chunks after cached context, packed in one batch."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d, bs, num_blocks = 32, 16, 64
    shape = [(1, 1), (1, 70), (5, 5), (7, 90), (33, 40)]  # (new rows, sequence length after them)
    tables = shuffled_tables(g, len(shape), 6, num_blocks)
    t = sum(n for n, _ in shape)
    q = torch.randn(t, heads, d, generator=g).to(DEV, dtype)
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).to(DEV, dtype)
    cu = torch.tensor([0] + [n for n, _ in shape]).cumsum(0)
    meta = AttnMeta(slot_mapping=torch.zeros(t, dtype=torch.long), cu_q=cu, seq_lens=torch.tensor([n for _, n in shape]),
                    block_tables=tables, max_q_len=max(n for n, _ in shape))
    want = reference_paged_attention(q.float(), cache[0].float(), cache[1].float(), meta)
    dev = lambda x: x.to(DEV)  # noqa: E731

    def kernel(rows: torch.Tensor, m: AttnMeta, block_q: int, spare_programs: int = 0) -> torch.Tensor:
        q_lens = (m.cu_q[1:] - m.cu_q[:-1]).tolist()
        cu_qb = query_blocks(q_lens, block_q)
        return paged_attention(rows, cache[0], cache[1], dev(m.cu_q), dev(m.seq_lens), dev(m.block_tables),
                               dev(torch.tensor(cu_qb)), cu_qb[-1] + spare_programs, block_q)
    for block_q in {query_block(heads, kv_heads, False), 1 if heads // kv_heads >= 16 else 16}:
        torch.testing.assert_close(kernel(q, meta, block_q).float(), want.to(DEV), rtol=2e-2, atol=2e-2)
    # a graph's fixed grid: programs past the last query block return without writing
    torch.testing.assert_close(kernel(q, meta, 16, spare_programs=7).float(), want.to(DEV), rtol=2e-2, atol=2e-2)
    # a decode-only batch takes the small tile; a sequence without rows (graph padding) owns no program
    dec = AttnMeta(slot_mapping=torch.zeros(2, dtype=torch.long), cu_q=torch.tensor([0, 1, 2, 2]),
                   seq_lens=torch.tensor([1, 70, 0]), block_tables=tables[:3], max_q_len=1)
    got = kernel(q[:2], dec, query_block(heads, kv_heads, True))
    torch.testing.assert_close(got.float(), want[:2].to(DEV), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 6), (4, 1)])
def test_rope_and_cache_write_the_rows_as_rope_then_write_kv(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    """The fused kernel against apply_rope + write_kv: the same rotated queries, the same cache rows
    written (keys rotated, values as they were), every other row untouched."""
    from models.kernels.rope_cache import rope_and_cache
    from models.paged import write_kv
    g = torch.Generator().manual_seed(heads + kv_heads)
    t, d, blocks, bs, positions = 11, 32, 6, 4, 64
    qkv = torch.randn(t, heads + 2 * kv_heads, d, generator=g).to(DEV, dtype)
    table = torch.randn(positions, d // 2, generator=g)
    pos = torch.randint(0, positions, (t,), generator=g)
    cos, sin = (x.to(DEV) for x in rope_factors(table[pos].cos(), table[pos].sin(), dtype))
    slots = torch.randperm(blocks * bs, generator=g)[:t].to(DEV)
    cache = torch.randn(2, blocks, bs, kv_heads, d, generator=g).to(DEV, dtype)
    want_cache = cache.clone()
    q, k = apply_rope(qkv[:, :heads + kv_heads], cos, sin).split((heads, kv_heads), dim=1)
    write_kv(want_cache, slots, k, qkv[:, heads + kv_heads:])
    got = rope_and_cache(qkv, cos, sin, cache, slots, heads, kv_heads)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, q, **tol)
    torch.testing.assert_close(cache, want_cache, **tol)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(cache.view(2, -1, kv_heads, d)[:, untouched.to(DEV)],
                       want_cache.view(2, -1, kv_heads, d)[:, untouched.to(DEV)])


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_long_decode_rows_are_split_and_combined_as_one(dtype: torch.dtype) -> None:
    """Decode rows longer than a split (flash-decoding: parts over the grid, then combined) agree
    with the reference: at a split's edge, one past it, across many splits and at the cache's end;
    beside a short row, a prefill chunk after long context (never split) and a padding sequence."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d, bs = 8, 2, 32, 16
    max_blocks = 2048 // bs
    assert split_keys(max_blocks * bs) == 256  # 8 splits
    shape = [(1, 256), (1, 257), (1, 5), (1, 1500), (1, 2048), (9, 900), (0, 0)]  # (rows, length after)
    num_blocks = len(shape) * max_blocks + 1
    tables = shuffled_tables(g, len(shape), max_blocks, num_blocks)
    t = sum(n for n, _ in shape)
    q = torch.randn(t, heads, d, generator=g).to(DEV, dtype)
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).to(DEV, dtype)
    cu = torch.tensor([0] + [n for n, _ in shape]).cumsum(0)
    meta = AttnMeta(slot_mapping=torch.zeros(t, dtype=torch.long), cu_q=cu,
                    seq_lens=torch.tensor([n for _, n in shape]), block_tables=tables, max_q_len=9)
    want = reference_paged_attention(q.float(), cache[0].float(), cache[1].float(), meta)
    block_q = query_block(heads, kv_heads, False)
    cu_qb = query_blocks([n for n, _ in shape], block_q)
    got = paged_attention(q, cache[0], cache[1], cu.to(DEV), meta.seq_lens.to(DEV), tables.to(DEV),
                          torch.tensor(cu_qb).to(DEV), cu_qb[-1] + 3, block_q)
    torch.testing.assert_close(got.float(), want.to(DEV), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_fused_decode_gives_the_torch_path_logits(tiny_model, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file

    args = read_model_args(tiny_model)
    model = build_model(args, dtype=dtype, device=DEV)
    state = {}
    for f in sorted(tiny_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, spec in model.checkpoint_targets().items():
            t = state[key].to(dtype)
            params[spec.param][spec.dst_offset:spec.dst_offset + t.shape[0]].copy_(t)
    model.init_buffers()
    model.allocate_kv_cache(16, 16, DEV)
    prompt, table = [5, 6, 7, 8, 9], [3, 7]
    model(torch.tensor(prompt, device=DEV), torch.arange(5, device=DEV), sequence_meta(table, 0, 5, 16, DEV))
    before = model.kv_cache.clone()
    ids, pos = torch.tensor([3], device=DEV), torch.tensor([5], device=DEV)
    meta = sequence_meta(table, 5, 1, 16, DEV)
    want = model(ids, pos, meta).float()
    want_cache = model.kv_cache.clone()
    model.kv_cache.copy_(before)
    got = fused_decode(model, ids, pos, meta).float()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.02 * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(model.kv_cache.float(), want_cache.float(), rtol=2e-2, atol=2e-2)
