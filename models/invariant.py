"""Batch-invariant ops for `deterministic` engines: a row's result never depends on the other rows.

What breaks it elsewhere: a library picks its algorithm (tiles, split-K, vector or scalar code,
threads) by the shape of the call, and with it the order of a row's float sums, so the same row
gives other bits alone, in a batch of 17 or in a prefill chunk. Here:

- `linear` (RMSNorm of its input or silu(gate) * up, then the product, bias and the residual add):
  on CUDA the Triton kernels models/kernels/row_ops.py and invariant_matmul.py (K never split,
  one row's reduction in one program); elsewhere torch on tiles of a fixed TILE rows
  (the rows padded with zeros), one call per tile, so the library always sees the same shape. That
  a row is then summed the same way at every place in its tile is a property of the CPU's BLAS
  kernel (not of every one: some sum a tile's last rows in an edge kernel), so it is checked once
  per weight shape (`check_cpu_tiles`, run at start on the model's own weights); where it fails,
  every row is multiplied on its own (a one-row call on a fresh copy: slower, the same bits);
- `rms_norm` (the same fixed tiles) and `silu_mul` (elementwise), for probes and tests (the forward
  folds both into `linear`);
- `paged_attention`: on CUDA the paged Triton kernel with one query tile for decode and prefill and
  every row's keys in the same fixed splits, merged in order (models/paged.py), on CPU `chunked_attention` below: every
  query row walks the keys from position 0 in fixed KEY_CHUNK chunks with an online softmax, on
  tiles of QUERY_TILE rows. A chunk past a row's last key is all masked and changes nothing (its
  probabilities are exactly 0, the rescale exactly 1), so a row gets the same bits in a decode step
  (its keys only) and in a prefill chunk (up to the chunk's last position);
- `all_reduce`: two ranks add a + b, which gives the same bits in either order (float addition commutes);
  with more ranks NCCL's and gloo's rings add in an order that depends on the tensor's size, so
  the partial results are gathered and added in rank order instead.
Elementwise ops (residual adds, rotary, the embedding) are per element and already invariant.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

TILE = 16  # rows per torch call (CPU)
QUERY_TILE, KEY_CHUNK = 16, 64  # the CPU attention's tiles
log = logging.getLogger(__name__)
_tiles_agree: dict[tuple, bool] = {}  # CPU: (weight shape, dtype, prologue) -> a row's bits the same at every tile place


def per_tile(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """fn applied to `tile`-row slices of x (zero-padded to whole tiles), concatenated: fn only
    ever sees one shape."""
    m = x.shape[0]
    pad = -m % tile
    if pad or m == 0:
        x = torch.cat([x, x.new_zeros(pad or tile, *x.shape[1:])])
    return torch.cat([fn(x[i:i + tile]) for i in range(0, x.shape[0], tile)])[:m]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up], rounded as two torch ops round it."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return per_tile(lambda t: F.rms_norm(t, (t.shape[-1],), weight, eps), x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """prologue(x) @ weight^T (+ bias) (+ residual); prologue: RMSNorm (`norm_weight`) or
    silu(gate) * up (`gated`), or none."""
    if x.is_cuda:
        from models.kernels.invariant_matmul import invariant_matmul
        from models.kernels.row_ops import rms_norm_rows, silu_mul_rows
        x = x.contiguous()
        if gated:
            x = silu_mul_rows(x)
        if norm_weight is not None:
            x = rms_norm_rows(x, norm_weight, eps)
        return invariant_matmul(x, weight, bias=bias, residual=residual)

    def tile(t: torch.Tensor) -> torch.Tensor:
        if gated:
            t = silu_mul(t)
        if norm_weight is not None:
            t = F.rms_norm(t, (t.shape[-1],), norm_weight, eps)
        return F.linear(t, weight, bias)
    key = _key(weight, bias, norm_weight, gated)
    if key not in _tiles_agree:
        _tiles_agree[key] = tiles_agree(tile, x.shape[-1], x.dtype)
        if not _tiles_agree[key]:
            log.info("deterministic: this CPU's BLAS sums a row by its place in a tile for weight %s %s; "
                     "rows are multiplied one by one", tuple(weight.shape), weight.dtype)
    y = per_tile(tile, x) if _tiles_agree[key] else per_row(tile, x)
    return y if residual is None else residual + y


def _key(weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None, gated: bool) -> tuple:
    return tuple(weight.shape), weight.dtype, gated, norm_weight is not None, bias is not None


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row alone, as a fresh one-row tensor (same shape and alignment every time)."""
    if x.shape[0] == 0:
        return fn(x.new_zeros(1, *x.shape[1:]))[:0]
    return torch.cat([fn(x[i:i + 1].clone()) for i in range(x.shape[0])])


def tiles_agree(fn: Callable[[torch.Tensor], torch.Tensor], cols: int, dtype: torch.dtype) -> bool:
    """Whether fn on a TILE-row tile gives a row the same bits at each of the tile's places."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(cols, generator=g).to(dtype)
    alone = fn(torch.cat([row[None], torch.zeros(TILE - 1, cols, dtype=dtype)]))[0]
    for at in range(1, TILE):
        t = torch.randn(TILE, cols, generator=g).to(dtype)
        t[at] = row
        if not torch.equal(fn(t)[at], alone):
            return False
    return True


def check_cpu_tiles(model: torch.nn.Module) -> bool:
    """Run the tile check (above) on every product of the model's forward, as a deterministic
    forward calls them; True where every one keeps the fast tiled path."""
    layer, stack, eps = model.model.layers[0], model.model, model.args.rms_norm_eps
    attn, mlp = layer.self_attn, layer.mlp
    calls = [(attn.qkv_proj, dict(norm_weight=layer.input_layernorm.weight)), (attn.o_proj, {}),
             (mlp.gate_up_proj, dict(norm_weight=layer.post_attention_layernorm.weight)),
             (mlp.down_proj, dict(gated=True)), (model.lm_head, dict(norm_weight=stack.norm.weight))]
    for lin, kw in calls:
        cols = lin.weight.shape[1] * (2 if kw.get("gated") else 1)
        linear(torch.zeros(1, cols, dtype=lin.weight.dtype), lin.weight, lin.bias, eps=eps, **kw)
    return all(_tiles_agree[_key(lin.weight, lin.bias, kw.get("norm_weight"), kw.get("gated", False))]
               for lin, kw in calls)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """The sum over the tensor-parallel ranks, in an order that does not depend on x's size."""
    if tp_size <= 2:
        if tp_size == 2:
            dist.all_reduce(x)
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def chunked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_lens: list[int],
                      seq_lens: list[int], block_tables: torch.Tensor) -> torch.Tensor:
    """Causal attention of the packed queries `q [T, heads, d]` over a paged cache `[num_blocks,
    block_size, kv_heads, d]` (the contract of models/paged.py), batch-invariant: float32
    throughout, fixed tiles (see the module docstring). Returns `[T, heads, d]` in q's dtype."""
    block_size, kv_heads, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    heads = q.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    start = 0
    for b, (n, length) in enumerate(zip(q_lens, seq_lens)):
        if n == 0:
            continue
        keys_len = -(-length // KEY_CHUNK) * KEY_CHUNK
        blocks = block_tables[b, :-(-length // block_size)]
        keys = _padded(k_cache[blocks].flatten(0, 1)[:length].float(), keys_len).permute(1, 0, 2).contiguous()
        values = _padded(v_cache[blocks].flatten(0, 1)[:length].float(), keys_len).permute(1, 0, 2).contiguous()
        rows = q[start:start + n].float().view(n, kv_heads, group, d)
        pos = torch.arange(length - n, length)
        for i in range(0, n, QUERY_TILE):
            tile_pos = pos[i:i + QUERY_TILE]
            got = _attend(_padded(rows[i:i + QUERY_TILE], QUERY_TILE), _padded(tile_pos, QUERY_TILE, -1),
                          keys, values, int(tile_pos[-1]) + 1)
            out[start + i:start + i + len(tile_pos)] = got[:len(tile_pos)].reshape(-1, heads, d).to(q.dtype)
        start += n
    return out


def _padded(x: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    """x with rows appended (filled with `value`) up to `rows`."""
    extra = rows - x.shape[0]
    return x if extra == 0 else torch.cat([x, x.new_full((extra, *x.shape[1:]), value)])


def _attend(q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, last: int) -> torch.Tensor:
    """One query tile `[QT, kv_heads, group, d]` (positions `pos`, -1 for padding) over keys
    `[kv_heads, L, d]` from 0 up to `last`, KEY_CHUNK at a time, with an online softmax. Every
    product has the same shape whatever the tile holds ([kv_heads, QT * group, d] x [d, KEY_CHUNK]
    and [.., KEY_CHUNK] x [KEY_CHUNK, d]), so the library sums each row the same way."""
    qt, kvh, group, d = q.shape
    rows = q.permute(1, 0, 2, 3).reshape(kvh, qt * group, d) * d ** -0.5
    row_pos = pos.repeat_interleave(group)  # [QT * group]
    m = torch.full((kvh, qt * group), -1.0e30)
    l = torch.zeros(kvh, qt * group)
    acc = torch.zeros(kvh, qt * group, d)
    for c in range(0, last, KEY_CHUNK):
        s = torch.bmm(rows, keys[:, c:c + KEY_CHUNK].transpose(1, 2).contiguous())  # [kvh, QT * group, KEY_CHUNK]
        visible = torch.arange(c, c + KEY_CHUNK)[None, :] <= row_pos[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        l = l * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.bmm(p, values[:, c:c + KEY_CHUNK].contiguous())
        m = m_new
    out = acc / torch.where(l == 0, 1.0, l).unsqueeze(-1)
    return out.view(kvh, qt, group, d).permute(1, 0, 2, 3)
