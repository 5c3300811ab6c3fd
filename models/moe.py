"""A Mixture-of-Experts block (Qwen3-MoE `mlp`, Mixtral `block_sparse_moe`): a router picks each
token's top-k experts, each expert is a gated MLP, and the token's output is their weighted sum.

The experts' weights are stacked, one tensor per kind for the whole layer (`gate_up_proj [E, 2I,
H]`, `down_proj [E, H, I]`, and with block-wise FP8 their scales), whatever the checkpoint's count
of per-expert tensors (48 layers x 128 experts x 3 = 18,432 of them in Qwen3-30B-A3B): the arena
holds a few tensors per layer and an attach makes a few views. Under tensor parallelism every rank
holds every expert's slice of the FFN width (its outputs are summed across ranks, as a dense MLP's).
On CUDA the step is one fused routing pass and two grouped Triton products (models/kernels/moe.py);
elsewhere a loop over the experts that have tokens (CPU, tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .parallel import ShardSpec, all_reduce

EXPERT_NAMES = {"Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
                "MixtralForCausalLM": ("w1", "w3", "w2")}  # (gate, up, down) in the checkpoint


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 `[T, k]`, expert ids int64 `[T, k]`): softmax over every expert, the top k,
    renormalised to sum to 1 if asked (Mixtral's softmax over its top-k logits is the same). On CUDA
    one Triton launch (models/kernels/moe.py), elsewhere torch's ops."""
    if logits.is_cuda:
        from models.kernels.moe import route_tokens
        return route_tokens(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Router(nn.Module):
    """The gate: `weight [experts, hidden]`, the same on every rank, never quantized."""

    def __init__(self, experts: int, hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """Every expert's gate/up and down products, stacked; this rank's slice of each FFN."""

    def __init__(self, args: ModelArgs, tp: int, dtype: torch.dtype, device: torch.device | str, prefix: str) -> None:
        super().__init__()
        e, h = args.num_experts, args.hidden_size
        if args.expert_size % tp:
            raise ValueError(f"the experts' FFN width {args.expert_size} is not divisible by tp_size {tp}")
        i = args.expert_size // tp
        self.names = EXPERT_NAMES[args.arch]
        scheme = args.quant if args.quant is not None and args.quant.quantizes(f"{prefix}.0.{self.names[0]}") else None
        if scheme is not None and scheme.kind != "block":
            raise ValueError("FP8 experts are supported block-wise only (quantization_config.weight_block_size)")
        self.scheme, self.tp_size = scheme, tp
        wdtype = torch.float8_e4m3fn if scheme else dtype
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=wdtype, device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=wdtype, device=device), requires_grad=False)
        self.gate_up_scale = self.down_scale = None
        if scheme:
            bn, bk = scheme.block
            if i % bn or i % bk or h % bn or h % bk:
                raise ValueError(f"the experts' {i}-wide FFN slice and hidden size {h} are not whole {bn}x{bk} "
                                 "blocks (quantization_config.weight_block_size)")
            self.gate_up_scale = nn.Parameter(torch.empty(e, 2 * i // bn, h // bk, dtype=torch.float32, device=device),
                                              requires_grad=False)
            self.down_scale = nn.Parameter(torch.empty(e, h // bn, i // bk, dtype=torch.float32, device=device),
                                           requires_grad=False)

    def checkpoint_targets(self, module_name: str) -> dict[str, ShardSpec]:
        """Each expert's gate, up and down (and their scales) into the stacked parameters."""
        gate, up, down = self.names
        e, two_i, h = self.gate_up_proj.shape
        i, tp = two_i // 2, self.tp_size
        out: dict[str, ShardSpec] = {}
        kinds = [("weight", "gate_up_proj", "down_proj", 1)]
        if self.scheme:
            kinds.append((self.scheme.scale_name, "gate_up_scale", "down_scale", 0))
        for x in range(e):
            at = f"{module_name}.{x}"
            for suffix, gu_param, d_param, is_weight in kinds:
                rn, rk = (1, 1) if is_weight else self.scheme.block
                gu = (i * tp // rn, h // rk)
                out[f"{at}.{gate}.{suffix}"] = ShardSpec(f"{module_name}.{gu_param}", 0, gu, 0, x)
                out[f"{at}.{up}.{suffix}"] = ShardSpec(f"{module_name}.{gu_param}", 0, gu, i // rn, x)
                out[f"{at}.{down}.{suffix}"] = ShardSpec(f"{module_name}.{d_param}", 1, (h // rn, i * tp // rk), 0, x)
        return out

    def dequantized(self, experts: int | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up `[2I, H]`, down `[H, I]`) of one expert in `dtype`; of a tensor of ids, both stacked
        (`[E, 2I, H]`, `[E, H, I]`)."""
        if self.scheme is None:
            return self.gate_up_proj[experts].to(dtype), self.down_proj[experts].to(dtype)
        bn, bk = self.scheme.block

        def deq(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return (w.float() * s.repeat_interleave(bn, -2).repeat_interleave(bk, -1)).to(dtype)
        return deq(self.gate_up_proj[experts], self.gate_up_scale[experts]), deq(self.down_proj[experts],
                                                                                 self.down_scale[experts])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of `sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`, `[T, H]` in x's dtype."""
        if x.is_cuda:
            from models.kernels.moe import fused_experts
            scales = (self.gate_up_scale, self.down_scale) if self.scheme else None
            return fused_experts(x, weights, ids, self.gate_up_proj, self.down_proj, scales,
                                 self.scheme.block if self.scheme else None)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in ids.unique().tolist():
            tokens, slot = (ids == expert).nonzero(as_tuple=True)
            gate_up, down = self.dequantized(expert, x.dtype)
            gate, up = F.linear(x[tokens], gate_up).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down)
            out.index_add_(0, tokens, y.float() * weights[tokens, slot, None])
        return out.to(x.dtype)


class SparseMoE(nn.Module):
    """Router + experts: `[T, H]` -> `[T, H]` (summed across tensor-parallel ranks)."""

    def __init__(self, args: ModelArgs, tp: int, dtype: torch.dtype, device: torch.device | str, prefix: str) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.tp_size = args.num_experts_per_tok, args.norm_topk_prob, tp
        self.gate = Router(args.num_experts, args.hidden_size, dtype, device)
        self.experts = Experts(args, tp, dtype, device, f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return all_reduce(self.experts(x, weights, ids), self.tp_size)
