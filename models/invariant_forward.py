"""The forward pass of a `deterministic` engine: every op batch-invariant (models/invariant.py).

Same contract as `Decoder.forward`, for any step (decode rows, prefill chunks, both): a row's
logits, and the keys and values it writes, depend only on its sequence's tokens up to it, never
on the other rows of the step, the step's size, the chunking of the prompt, a prefix-cache hit or
a CUDA graph's padding. Per layer: RMSNorm+qkv, rotary+KV write, attention, o_proj+residual,
RMSNorm+gate_up, silu*up+down+residual (the prologues and epilogues folded into the products, as
in models/fused_decode.py); under tensor parallelism the row-parallel sums come between
the product and the residual, in a fixed order.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .invariant import all_reduce, linear
from .parallel import ShardedLinear, all_gather_last_dim
from .rope import rope_factors

if TYPE_CHECKING:
    from .decoder import Decoder
    from .paged import AttnMeta


def invariant_forward(model: Decoder, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttnMeta) -> torch.Tensor:
    stack, tp = model.model, model.tp_size
    eps = model.args.rms_norm_eps
    x = stack.embed_tokens(input_ids)  # under TP one rank's row plus zeros: exact in any order
    cos, sin = rope_factors(stack.rope_cos[positions], stack.rope_sin[positions], x.dtype)

    def row_parallel(a: torch.Tensor, lin: ShardedLinear, residual: torch.Tensor, gated: bool = False) -> torch.Tensor:
        if tp == 1:
            return linear(a, lin.weight, lin.bias, gated=gated, residual=residual)
        y = all_reduce(linear(a, lin.weight, gated=gated), tp)
        return residual + (y if lin.bias is None else y + lin.bias)

    for i, layer in enumerate(stack.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=layer.input_layernorm.weight, eps=eps)
        o = attn.attend(qkv, cos, sin, meta, model.kv_cache[i], deterministic=True)
        x = row_parallel(o.reshape(x.shape[0], -1), attn.o_proj, x)
        gate_up = linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                         norm_weight=layer.post_attention_layernorm.weight, eps=eps)
        x = row_parallel(gate_up, mlp.down_proj, x, gated=True)
    if meta.logit_rows is not None:
        x = x[meta.logit_rows]
    logits = linear(x, model.lm_head.weight, norm_weight=stack.norm.weight, eps=eps)
    return all_gather_last_dim(logits, tp)


def check_product_tiles(model: Decoder) -> bool:
    """Whether this GPU gives the product's small-batch and large-batch tiles the same bits on the
    model's weights (layer 0's products and the head: every shape the forward multiplies by);
    where not, every product from here on takes one tile (models/kernels/invariant_matmul.py)."""
    from models.kernels.invariant_matmul import check_tiles
    layer = model.model.layers[0]
    return check_tiles([layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                        layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight, model.lm_head.weight])
