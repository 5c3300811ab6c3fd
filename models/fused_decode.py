"""Batch-1 decode through fused kernels (models/kernels) on CUDA: five kernels per decoder layer.

Per layer: RMSNorm+qkv, rotary+KV write+attention, o_proj+residual, RMSNorm+gate_up,
silu*up+down+residual (under tensor parallelism the row-parallel sums come between the product
and the residual). The torch path in decoder.py stays the reference and serves CPU, prefill and
larger batches, where cuBLAS is the better matrix product.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from .parallel import ShardedLinear, all_gather_last_dim, all_reduce

if TYPE_CHECKING:
    from .decoder import Decoder
    from .paged import AttnMeta

FUSED_MAX_BATCH = 1  # above it a linear is no longer a matrix-vector product


def fused_decode_unavailable(model: Decoder) -> str | None:
    """Why `model` cannot decode through the fused kernels, or None when it can."""
    if model.kv_cache is None:
        return "no KV cache allocated"
    if (beyond := model.args.beyond_plain()) is not None:
        return f"{beyond} (the kernels take plain Llama-family layers)"
    if model.kv_cache.device.type != "cuda":
        return f"device is {model.kv_cache.device.type}, the kernels need CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.cuda.get_device_capability(model.kv_cache.device) < (8, 0):
        return "the GPU is older than sm80 (the kernels were built and measured on sm90)"
    if max(p.numel() for p in model.parameters()) >= 2**31:
        return "a weight has 2^31 elements or more (the kernels index with 32 bits)"
    if model.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {model.dtype} (the kernels take bfloat16 or float16)"
    head_dim = model.args.head_dim
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two of at least 16"
    group = model.args.num_attention_heads // model.args.num_key_value_heads
    if group > 16:
        return f"{group} query heads per KV head (the attention kernel takes up to 16)"
    return None


def fused_decode(model: Decoder, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """Logits `[1, vocab]` for one decode token; same contract as `Decoder.forward` for a decode-only step."""
    from models.kernels.attention import decode_attention
    from models.kernels.gemv import fused_gemv

    stack, tp = model.model, model.tp_size
    eps = model.args.rms_norm_eps
    h = stack.embed_tokens(input_ids)
    cos, sin = stack.rope_cos[positions], stack.rope_sin[positions]

    def row_parallel(x: torch.Tensor, lin: ShardedLinear, residual: torch.Tensor, gated: bool = False) -> torch.Tensor:
        if tp == 1:
            return fused_gemv(x, lin.weight, bias=lin.bias, gated=gated, residual=residual)
        y = all_reduce(fused_gemv(x, lin.weight, gated=gated), tp)
        return residual + (y if lin.bias is None else y + lin.bias)

    for i, layer in enumerate(stack.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fused_gemv(h, attn.qkv_proj.weight, bias=attn.qkv_proj.bias,
                         norm_weight=layer.input_layernorm.weight, eps=eps)
        o = decode_attention(qkv, model.kv_cache[i], cos, sin, meta.block_tables, positions, attn.heads, attn.kv_heads)
        h = row_parallel(o, attn.o_proj, h)
        gate_up = fused_gemv(h, mlp.gate_up_proj.weight, bias=mlp.gate_up_proj.bias,
                             norm_weight=layer.post_attention_layernorm.weight, eps=eps)
        h = row_parallel(gate_up, mlp.down_proj, h, gated=True)
    logits = fused_gemv(h, model.lm_head.weight, norm_weight=stack.norm.weight, eps=eps)
    return all_gather_last_dim(logits, tp)
