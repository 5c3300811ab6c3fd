"""The decoder's layers: RMSNorm, attention over the paged KV cache (with Qwen3's query and key norms),
the dense gated MLP, and the linear each takes (bf16/fp32, or FP8 where the checkpoint says so)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .fp8 import Fp8Linear
from .paged import AttnMeta, paged_attention, write_kv
from .parallel import ShardedLinear
from .rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel; it accumulates in float32 as HF does (HF also rounds before scaling).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_linear(args: ModelArgs, parts: list[str], in_features: int, out_features: int, bias: bool, shard_dim: int,
                tp: int, dtype: torch.dtype, device: torch.device | str) -> ShardedLinear | Fp8Linear:
    """The linear of the checkpoint modules `parts` (fused in this order): FP8 where the checkpoint's
    quantization covers them (all of them or none), else in the compute dtype."""
    scheme = args.quant
    fp8 = [p for p in parts if scheme is not None and scheme.quantizes(p)]
    if fp8 and len(fp8) != len(parts):
        raise ValueError(f"{', '.join(parts)} are fused into one product but only {', '.join(fp8)} are FP8 "
                         "(quantization_config's ignored modules split them)")
    if fp8:
        try:
            return Fp8Linear(in_features, out_features, bias, shard_dim, tp, dtype, device, scheme, len(parts))
        except ValueError as e:
            raise ValueError(f"{', '.join(parts)}: {e}") from None
    return ShardedLinear(in_features, out_features, bias, shard_dim, tp, dtype, device)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, tp: int, dtype: torch.dtype, device: torch.device | str, prefix: str) -> None:
        super().__init__()
        if args.num_key_value_heads % tp:
            raise ValueError(f"num_key_value_heads {args.num_key_value_heads} is not divisible by tp_size {tp}")
        self.heads, self.kv_heads, self.head_dim = (args.num_attention_heads // tp,
                                                    args.num_key_value_heads // tp, args.head_dim)
        h, d = args.hidden_size, args.head_dim
        qkv_out = (args.num_attention_heads + 2 * args.num_key_value_heads) * d
        self.qkv_proj = make_linear(args, [f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")], h, qkv_out,
                                    args.qkv_bias, 0, tp, dtype, device)
        self.o_proj = make_linear(args, [f"{prefix}.o_proj"], args.num_attention_heads * d, h, False, 1, tp, dtype,
                                  device)
        self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype, device) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype, device) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta,
                kv: torch.Tensor) -> torch.Tensor:
        out = self.attend(self.qkv_proj(x), cos, sin, meta, kv)
        return self.o_proj(out.reshape(x.shape[0], self.heads * self.head_dim))

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta, kv: torch.Tensor,
               deterministic: bool = False) -> torch.Tensor:
        """Rotary on q and k, k and v into the cache, attention: `qkv [T, (heads + 2 kv) d]` -> `[T, heads, d]`."""
        qkv = qkv.view(qkv.shape[0], self.heads + 2 * self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k, v = qkv.split((self.heads, self.kv_heads, self.kv_heads), dim=1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=1)
        if qkv.is_cuda:
            from models.kernels.rope_cache import rope_and_cache
            q = rope_and_cache(qkv, cos, sin, kv, meta.slot_mapping, self.heads, self.kv_heads)
        else:
            q, k = apply_rope(qkv[:, :self.heads + self.kv_heads], cos, sin).split((self.heads, self.kv_heads), dim=1)
            write_kv(kv, meta.slot_mapping, k, qkv[:, self.heads + self.kv_heads:])
        return paged_attention(q, kv, meta, deterministic)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, tp: int, dtype: torch.dtype, device: torch.device | str, prefix: str) -> None:
        super().__init__()
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_up_proj = make_linear(args, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], h, 2 * i, b, 0, tp,
                                        dtype, device)
        self.down_proj = make_linear(args, [f"{prefix}.down_proj"], i, h, b, 1, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
