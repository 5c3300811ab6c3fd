"""One compact decoder for Llama, Qwen2, Mistral, Qwen3-MoE and Mixtral checkpoints (bf16, fp32 or FP8),
tensor parallel, KV-cache aware: its modules, weights, KV cache and eager forward
(models/causal_lm.py picks the forward).

Module and parameter names match the HF checkpoints, so a checkpoint key *is* a parameter name.

Forward API (`CausalLM.forward(input_ids, positions, meta)`): one flat batch of `T` rows from any
number of sequences (decode rows and prefill chunks alike), `positions[t]` the row's position in
its sequence, `meta` an `AttnMeta` (models/paged.py) saying where each row's keys and
values go in the paged KV cache and which positions each sequence has. Returns the logits of the
rows `meta.logit_rows` (every row when None) `[S, vocab]`. A decode-only step is shape-static
given its batch size, so it can be captured in a CUDA graph.
The KV cache is one tensor `[layers, 2, num_blocks, block_size, kv_heads_local, head_dim]` set by
`allocate_kv_cache`; it is not part of the state dict (it never goes to the weight arena).
"""
from __future__ import annotations

import torch
from torch import nn

from .args import MOE_ARCHS, ModelArgs
from .fp8 import Fp8Linear
from .layers import MLP, Attention, RMSNorm
from .moe import Experts, SparseMoE
from .paged import AttnMeta
from .parallel import ShardedLinear, ShardSpec, VocabShardedEmbedding, all_gather_last_dim
from .rope import cos_sin_table, rope_factors


class DecoderLayer(nn.Module):
    """Attention and a feed-forward block: the dense `mlp`, or experts (`mlp` in Qwen3-MoE,
    `block_sparse_moe` in Mixtral: the checkpoint's name, reached as `ffn`)."""

    def __init__(self, args: ModelArgs, tp: int, dtype: torch.dtype, device: torch.device | str, index: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.self_attn = Attention(args, tp, dtype, device, f"{prefix}.self_attn")
        self.ffn_name = MOE_ARCHS[args.arch] if args.moe_layer(index) else "mlp"
        ffn = SparseMoE if args.moe_layer(index) else MLP
        setattr(self, self.ffn_name, ffn(args, tp, dtype, device, f"{prefix}.{self.ffn_name}"))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)

    @property
    def ffn(self) -> MLP | SparseMoE:
        return getattr(self, self.ffn_name)

    def forward(self, x, cos, sin, meta, kv):  # noqa: ANN001, ANN201 (hot path)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv)
        return x + self.ffn(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`model.*` in HF naming: embeddings, layers, final norm, and the rotary tables (buffers)."""

    def __init__(self, args: ModelArgs, tp_rank: int, tp: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = VocabShardedEmbedding(args.vocab_size, args.hidden_size, tp_rank, tp, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(args, tp, dtype, device, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        half = args.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(args.max_position_embeddings, half, device=device),
                             persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_position_embeddings, half, device=device),
                             persistent=False)


class Decoder(nn.Module):
    """A Llama-family causal LM holding rank `tp_rank` of `tp_size` shards; `forward` is the eager path."""

    def __init__(self, args: ModelArgs, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.args, self.tp_rank, self.tp_size, self.dtype = args, tp_rank, tp_size, dtype
        self.model = DecoderStack(args, tp_rank, tp_size, dtype, device)
        self.lm_head = ShardedLinear(args.hidden_size, args.vocab_size, False, 0, tp_size, dtype, device)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_cache: torch.Tensor | None = None
        self.use_fused_decode = False  # decode batches up to FUSED_MAX_BATCH through models/kernels (CUDA)
        self.deterministic = False  # batch-invariant ops (models/invariant_forward.py)

    # ---- weights -------------------------------------------------------------------------
    def checkpoint_targets(self) -> dict[str, ShardSpec]:
        """Checkpoint key -> ShardSpec for every tensor this rank loads (tied ones once)."""
        targets: dict[str, ShardSpec] = {}
        for module_name, module in self.named_modules():
            if isinstance(module, Experts):
                targets.update(module.checkpoint_targets(module_name))
                continue
            parent, _, leaf = module_name.rpartition(".")
            parts = self._fused_parts(leaf)
            for pname, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{pname}" if module_name else pname
                if name == "lm_head.weight" and self.args.tie_word_embeddings:
                    continue
                dim = _shard_dim(module, pname)
                scale = isinstance(module, Fp8Linear) and (pname == "input_scale" or pname == "weight_scale"
                                                           and module.scheme.kind == "rows")  # (one value, or per row)
                if parts is None:
                    targets[name] = ShardSpec(name, dim, _full_shape(param.shape, dim, self.tp_size), broadcast=scale)
                    continue
                # rows per unit of `parts`, in the weight's rows (a block scale has one row per bn of them)
                unit, offset = module.weight.shape[0] // sum(parts.values()), 0
                per_row = module.scale_rows if param.shape[0] != module.weight.shape[0] else 1
                for i, (part, units) in enumerate(parts.items()):
                    key = f"{parent}.{part}.{pname}"
                    if pname == "input_scale":  # one per part, made one by process_weights
                        targets[key] = ShardSpec(name, None, (), i, broadcast=True)
                        continue
                    local = (units * unit // per_row, *param.shape[1:])
                    targets[key] = ShardSpec(name, dim, _full_shape(local, dim, self.tp_size), offset, broadcast=scale)
                    offset += local[0]
        return targets

    def _fused_parts(self, leaf: str) -> dict[str, int] | None:
        """For a fused module, its checkpoint modules in row order with their relative sizes."""
        if leaf == "qkv_proj":
            kv = self.args.num_key_value_heads
            return {"q_proj": self.args.num_attention_heads, "k_proj": kv, "v_proj": kv}
        if leaf == "gate_up_proj":
            return {"gate_proj": 1, "up_proj": 1}
        return None

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the non-persistent buffers (rotary tables) in place, wherever they live."""
        cos, sin = cos_sin_table(self.args)
        self.model.rope_cos.copy_(cos)
        self.model.rope_sin.copy_(sin)

    def process_weights(self) -> None:
        """What a load does once its tensors are in (the daemon's, or an engine's own from disk; an
        attach maps the result): the rotary tables, and each FP8 linear's processing."""
        self.init_buffers()
        for module in self.modules():
            if isinstance(module, Fp8Linear):
                module.process_weights()

    def weight_bytes(self) -> int:
        """Bytes of parameters one forward pass reads on this rank (tied weights once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ---- KV cache ------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """Bytes of one KV block on this rank (every layer's keys and values for block_size positions)."""
        attn = self.model.layers[0].self_attn
        elem = torch.empty((), dtype=dtype or self.dtype).element_size()
        return len(self.model.layers) * 2 * attn.kv_heads * block_size * attn.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device: torch.device | str,
                          dtype: torch.dtype | None = None) -> None:
        attn = self.model.layers[0].self_attn
        self.kv_cache = torch.zeros(len(self.model.layers), 2, num_blocks, block_size, attn.kv_heads,
                                    attn.head_dim, dtype=dtype or self.dtype, device=device)

    def use_kv_cache(self, kv: torch.Tensor, block_size: int) -> None:
        """Run on `kv` (a shared pool's view) instead of a cache of our own; its shape must be ours."""
        attn = self.model.layers[0].self_attn
        want = (len(self.model.layers), 2, kv.shape[2], block_size, attn.kv_heads, attn.head_dim)
        if tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise ValueError(f"a KV cache of shape {tuple(kv.shape)} {kv.dtype} does not fit this model "
                             f"({want} {self.dtype})")
        self.kv_cache = kv

    # ---- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        stack = self.model
        x = stack.embed_tokens(input_ids)
        cos, sin = rope_factors(stack.rope_cos[positions], stack.rope_sin[positions], x.dtype)
        for i, layer in enumerate(stack.layers):
            x = layer(x, cos, sin, meta, self.kv_cache[i])
        if meta.logit_rows is not None:
            x = x[meta.logit_rows]
        return all_gather_last_dim(self.lm_head(stack.norm(x)), self.tp_size)


def _full_shape(local: tuple[int, ...] | torch.Size, dim: int | None, tp_size: int) -> tuple[int, ...]:
    full = list(local)
    if dim is not None:
        full[dim] *= tp_size
    return tuple(full)


def _shard_dim(module: nn.Module, pname: str) -> int | None:
    if isinstance(module, ShardedLinear):
        return module.shard_dim if pname == "weight" or module.shard_dim == 0 else None
    if isinstance(module, Fp8Linear):
        if pname == "input_scale":
            return None
        block_scale = pname == module.scheme.scale_name and module.scheme.kind == "block"
        return module.shard_dim if pname == "weight" or block_scale or module.shard_dim == 0 else None
    if isinstance(module, VocabShardedEmbedding):
        return 0
    return None
