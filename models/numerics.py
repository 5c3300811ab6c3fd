"""Semantic readiness, part 1: the engine's own numerics on the weights it mapped, against an
independent float32 reference (DESIGN.md §2), before the engine may go READY.

On a fixed input (16 tokens), the first and last decoder layers and the LM head run through the
engine's own code and kernels (paged attention, FP8 products with quantized activations, the fused
MoE, whatever this device takes), and again through plain float32 PyTorch written here: RMSNorm,
dequantized weights (each FP8 block times its scale), rotary, causal softmax attention, the gated
MLP or top-k experts. Attention and the feed-forward block are compared apart (the block's output,
which the residual would otherwise hide; the feed-forward block on the engine's own input to it),
as a relative RMS error. A MoE block is checked in two parts, so that every token counts however
often experts nearly tie (with 128 experts and top-8, about half the tokens of random weights have a
k-th and (k+1)-th expert within 2%): the engine's picks, each of which must be among float32's top k
up to that margin, and the experts' weighted sum on the engine's picks with float32's weights for
them. On FP8 tensor cores, layer 0's q/k/v product runs once more at 128 rows, where a product may
take another kernel (cuBLAS's block-scaled one). What it catches: scales ignored
or misapplied, a wrong layout or transpose, a kernel that computes wrongly on this device. What it
cannot: weights that are wrong in the arena itself (the fingerprint's content digest and the
canary's golden answer cover those), and faults at other batch sizes than the one it runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .decoder import Decoder, DecoderLayer
from .fp8 import Fp8Linear, has_fp8_cores
from .layers import MLP
from .moe import SparseMoE, route
from .paged import sequence_meta
from .parallel import all_gather_last_dim, all_reduce
from .rope import cos_sin_table, rope_factors

TOKENS = 16
MANY_ROWS = 128  # an FP8 product checked apart at this many rows (from models.kernels.fp8.CUBLAS_ROWS: cuBLAS's)
# Relative RMS error allowed, by how the engine computes (measured margins: bench/RESULTS.md)
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
FP8_TOLERANCE = 1e-1  # activations quantized to float8 per token group at run time
EXPERT_BYTES = 256 << 20  # float32 expert weights the reference dequantizes at once
NEAR_TIE = 2e-2  # routing logits this close (relative to the largest) may rank either way in bfloat16


class NumericsError(ValueError):
    """The engine computes its model wrongly on this device: it must not serve."""


class Part(NamedTuple):
    """One part checked: its error against float32, and the most allowed."""

    name: str
    error: float
    tolerance: float
    measure: str = "relative error"


@dataclass
class NumericsCheck:
    """Each part checked, and the time it took."""

    parts: list[Part]
    seconds: float

    @property
    def failed(self) -> list[Part]:
        return [p for p in self.parts if not p.error <= p.tolerance]  # (NaN fails)

    def summary(self) -> str:
        return ", ".join(f"{p.name} {p.error:.1e} (<= {p.tolerance:.0e})" for p in self.parts) + \
            f"; {self.seconds * 1e3:.0f} ms"

    def raise_if_failed(self) -> None:
        if self.failed:
            name, err, tol, measure = self.failed[0]
            raise NumericsError(f"numerics check failed: {name}: {measure} {err:.3g} against float32 PyTorch "
                                f"on the same dequantized weights (tolerance {tol:g}); this engine computes the "
                                "model wrongly here and will not serve it")


def tolerance(model: Decoder, device: torch.device) -> float:
    fp8 = any(isinstance(m, Fp8Linear) and m.scheme.activations != "none" for m in model.modules()) or any(
        isinstance(m, SparseMoE) and m.experts.scheme is not None for m in model.modules())
    return FP8_TOLERANCE if fp8 and has_fp8_cores(device) else TOLERANCE[model.dtype]


@torch.inference_mode()
def check_numerics(model: Decoder, device: torch.device) -> NumericsCheck:
    """Run the check (every tensor-parallel rank together: the products sum across ranks)."""
    t0 = time.perf_counter()
    args, stack, tp = model.args, model.model, model.tp_size
    g = torch.Generator().manual_seed(20261207)
    ids = torch.randint(0, args.vocab_size, (TOKENS,), generator=g).to(device)
    positions = torch.arange(TOKENS, device=device)
    tol = tolerance(model, device)
    attn = stack.layers[0].self_attn
    kv = torch.zeros(2, 2, TOKENS, attn.kv_heads, attn.head_dim, dtype=model.dtype, device=device)
    meta = sequence_meta([1], 0, TOKENS, TOKENS, device)  # (block 0 stays the padding block)
    cos32, sin32 = (t.to(device)[:TOKENS] for t in cos_sin_table(args))
    cos, sin = rope_factors(stack.rope_cos[positions], stack.rope_sin[positions], model.dtype)
    parts = []
    for i in sorted({0, len(stack.layers) - 1}):
        layer = stack.layers[i]
        x = stack.embed_tokens(ids) if i == 0 else _hidden(g, TOKENS, args.hidden_size, device, model.dtype)
        got = layer.self_attn(layer.input_layernorm(x), cos, sin, meta, kv).float()
        want = _reference_attention(layer, x.float(), cos32, sin32, tp)
        parts.append(Part(f"layer {i} attention", _relative(got, want), tol))
        m = layer.post_attention_layernorm(x)  # the same input for both: the products are what is compared
        if isinstance(layer.ffn, MLP):
            got = layer.ffn(m).float()
            parts.append(Part(f"layer {i} MLP", _relative(got, _reference_mlp(layer.ffn, m.float(), tp)), tol))
        else:
            parts += _moe_parts(layer.ffn, m, tp, f"layer {i}", tol)
    parts += _many_rows(stack.layers[0].self_attn.qkv_proj, g, device, model.dtype, tol)
    x = _hidden(g, TOKENS, args.hidden_size, device, model.dtype)
    got = all_gather_last_dim(model.lm_head(stack.norm(x)), tp).float()
    want = all_gather_last_dim(_reference_linear(model.lm_head, _rms(x.float(), stack.norm.weight, stack.norm.eps)), tp)
    parts.append(Part("LM head", _relative(got, want), TOLERANCE[model.dtype] if tol == FP8_TOLERANCE else tol))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return NumericsCheck(parts, time.perf_counter() - t0)


def _many_rows(linear: torch.nn.Module, g: torch.Generator, device: torch.device, dtype: torch.dtype,
               tol: float) -> list[Part]:
    """An FP8 product at MANY_ROWS rows, on its own: past CUBLAS_ROWS it may run another kernel (cuBLAS's)."""
    if not (isinstance(linear, Fp8Linear) and tol == FP8_TOLERANCE):
        return []
    x = _hidden(g, MANY_ROWS, linear.weight.shape[1], device, dtype)
    got = linear.product(x).float()
    return [Part(f"layer 0 q/k/v product at {MANY_ROWS} rows", _relative(got, x.float() @ _weight(linear).T), tol)]


def _hidden(g: torch.Generator, rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, cols, generator=g).to(device, dtype)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative RMS error where the reference is finite (an overflowing model overflows in float32 too:
    there the reference says nothing); the engine non-finite where the reference is not: inf."""
    ok = torch.isfinite(want)
    if not bool(torch.isfinite(got[ok]).all()):
        return float("inf")
    got, want = got[ok], want[ok]
    return float((got - want).norm() / want.norm().clamp(min=1e-30)) if want.numel() else 0.0


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _weight(linear: torch.nn.Module) -> torch.Tensor:
    return linear.dequantized() if isinstance(linear, Fp8Linear) else linear.weight.float()


def _reference_linear(linear: torch.nn.Module, x: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """x @ W^T in float32, W dequantized a chunk of rows at a time (an LM head is large)."""
    if isinstance(linear, Fp8Linear):
        y = x @ linear.dequantized().T
    else:
        y = torch.cat([x @ linear.weight[r:r + chunk].float().T for r in range(0, linear.weight.shape[0], chunk)], -1)
    return y if linear.bias is None else y + linear.bias.float()


def _row_parallel(linear: torch.nn.Module, x: torch.Tensor, tp: int) -> torch.Tensor:
    y = all_reduce(x @ _weight(linear).T, tp)
    return y if linear.bias is None else y + linear.bias.float()


def _reference_attention(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         tp: int) -> torch.Tensor:
    attn = layer.self_attn
    h, kvh, d = attn.heads, attn.kv_heads, attn.head_dim
    a = _rms(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
    qkv = _reference_linear(attn.qkv_proj, a)
    q, k, v = qkv.view(x.shape[0], h + 2 * kvh, d).split((h, kvh, kvh), dim=1)
    if attn.q_norm is not None:
        q, k = _rms(q, attn.q_norm.weight, attn.q_norm.eps), _rms(k, attn.k_norm.weight, attn.k_norm.eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool, device=x.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    o = torch.einsum("hqk,khd->qhd", probs, v).reshape(x.shape[0], h * d)
    return _row_parallel(attn.o_proj, o, tp)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half rotary on `[tokens, heads, d]` with float32 `cos/sin [tokens, d / 2]`."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _reference_mlp(mlp: MLP, x: torch.Tensor, tp: int) -> torch.Tensor:
    gate, up = _reference_linear(mlp.gate_up_proj, x).chunk(2, dim=-1)
    return _row_parallel(mlp.down_proj, F.silu(gate) * up, tp)


def _moe_parts(moe: SparseMoE, x: torch.Tensor, tp: int, at: str, tol: float) -> list[Part]:
    """The engine's routing (the share of its picks outside float32's top k, beyond NEAR_TIE: none
    allowed), and its experts' weighted sum on those picks against float32's."""
    weights, ids = route(moe.gate(x), moe.top_k, moe.renormalize)  # (the engine's own path: SparseMoE.forward)
    got = all_reduce(moe.experts(x, weights, ids), tp).float()
    logits = x.float() @ moe.gate.weight.float().T
    kth = logits.topk(moe.top_k, -1).values[:, -1:]
    outside = logits.gather(-1, ids) < kth - NEAR_TIE * logits.abs().amax(-1, keepdim=True)
    want = _reference_experts(moe, x, logits, ids, tp)
    return [Part(f"{at} routing", float(outside.float().mean()), 0.0,
                 f"share of its {ids.numel()} picks outside float32's top {moe.top_k}"),
            Part(f"{at} experts", _relative(got, want), tol)]


def _reference_experts(moe: SparseMoE, x: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                       tp: int) -> torch.Tensor:
    """The experts `ids` picked, summed in float32 with float32's routing weights for them: every
    token through every picked expert, a few experts' weights dequantized at a time (one launch per
    product and no host sync per expert: 128 experts cost what 8 do)."""
    weights = torch.softmax(logits, -1).gather(-1, ids)
    if moe.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    mix = torch.zeros_like(logits).scatter_add_(-1, ids.long(), weights)  # [T, experts]: each token's weight on each
    xf, out = x.float(), torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    _, two_i, h = moe.experts.gate_up_proj.shape
    for chunk in ids.unique().split(max(1, EXPERT_BYTES // (3 * two_i * h * 2))):  # (fp32: 4 bytes, 1.5 matrices)
        gate_up, down = moe.experts.dequantized(chunk, torch.float32)
        gate, up = torch.einsum("th,eih->eti", xf, gate_up).chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, down)
        out += torch.einsum("te,eth->th", mix[:, chunk], y)
    return all_reduce(out, tp)
