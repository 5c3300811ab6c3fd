"""Semantic readiness, part 1: the engine's own numerics on the weights it mapped, against an
independent float32 reference (DESIGN.md §2), before the engine may go READY.

On a fixed input (16 tokens), the first and last decoder layers and the LM head run through the
engine's own code and kernels (paged attention, FP8 products with quantized activations, the fused
MoE, whatever this device takes), and again through plain float32 PyTorch written here: RMSNorm,
dequantized weights (each FP8 block times its scale), rotary, causal softmax attention, the gated
MLP or top-k experts. Attention and the feed-forward block are compared apart (the block's output,
which the residual would otherwise hide; the feed-forward block on the engine's own input to it,
so that routing sees the same numbers), as a relative RMS error; a token whose k-th and (k+1)-th
experts nearly tie is left out (either pick is right). What it catches: scales ignored
or misapplied, a wrong layout or transpose, a kernel that computes wrongly on this device. What it
cannot: weights that are wrong in the arena itself (the fingerprint's content digest and the
canary's golden answer cover those), and faults at other batch sizes than the one it runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

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
# Relative RMS error allowed, by how the engine computes (measured margins: bench/RESULTS.md)
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
FP8_TOLERANCE = 1e-1  # activations quantized to float8 per token group at run time
NEAR_TIE = 2e-2  # routing logits this close (relative to the largest) may rank either way in bfloat16


class NumericsError(ValueError):
    """The engine computes its model wrongly on this device: it must not serve."""


@dataclass
class NumericsCheck:
    """Each part checked: (name, relative error, tolerance), and the time it took."""

    parts: list[tuple[str, float, float]]
    seconds: float

    @property
    def failed(self) -> list[tuple[str, float, float]]:
        return [p for p in self.parts if not p[1] <= p[2]]  # (NaN fails)

    def summary(self) -> str:
        return ", ".join(f"{name} {err:.1e} (<= {tol:.0e})" for name, err, tol in self.parts) + \
            f"; {self.seconds * 1e3:.0f} ms"

    def raise_if_failed(self) -> None:
        if self.failed:
            name, err, tol = self.failed[0]
            raise NumericsError(f"numerics check failed: {name}: relative error {err:.3g} against float32 PyTorch "
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
        parts.append((f"layer {i} attention", _relative(got, want), tol))
        m = layer.post_attention_layernorm(x)  # the same input for both: the products are what is compared
        got = layer.ffn(m).float()
        if isinstance(layer.ffn, MLP):
            parts.append((f"layer {i} MLP", _relative(got, _reference_mlp(layer.ffn, m.float(), tp)), tol))
        else:
            want, clear = _reference_moe(layer.ffn, m, tp)
            err = _relative(got[clear], want[clear]) if int(clear.sum()) >= TOKENS // 2 else float("nan")
            parts.append((f"layer {i} experts ({int(clear.sum())} of {TOKENS} tokens clearly routed)", err, tol))
    x = _hidden(g, TOKENS, args.hidden_size, device, model.dtype)
    got = all_gather_last_dim(model.lm_head(stack.norm(x)), tp).float()
    want = all_gather_last_dim(_reference_linear(model.lm_head, _rms(x.float(), stack.norm.weight, stack.norm.eps)), tp)
    parts.append(("LM head", _relative(got, want), TOLERANCE[model.dtype] if tol == FP8_TOLERANCE else tol))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return NumericsCheck(parts, time.perf_counter() - t0)


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


def _reference_moe(moe: SparseMoE, x: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' sum in float32, and which tokens count: those whose k-th and (k+1)-th experts are
    clearly apart (where they nearly tie, the engine's rounding may pick the other one, rightly)."""
    logits = x.float() @ moe.gate.weight.float().T
    weights, ids = route(logits, moe.top_k, moe.renormalize)
    clear = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if logits.shape[-1] > moe.top_k:  # k-th and (k+1)-th logits within the model dtype's rounding of the largest
        ranked = logits.topk(moe.top_k + 1, -1).values
        clear = (ranked[:, -2] - ranked[:, -1]) > NEAR_TIE * logits.abs().amax(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        tokens, slot = (ids == expert).nonzero(as_tuple=True)
        gate_up, down = moe.experts.dequantized(expert, torch.float32)
        gate, up = (x[tokens].float() @ gate_up.T).chunk(2, dim=-1)
        out.index_add_(0, tokens, ((F.silu(gate) * up) @ down.T) * weights[tokens, slot, None])
    return all_reduce(out, tp), clear
