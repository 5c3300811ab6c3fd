"""Tensor-parallel building blocks: where a checkpoint tensor goes on a rank, sharded linears and
embedding, and their collectives."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """Where a checkpoint tensor goes.

    Rank r takes the r-th of tp_size equal slices of the checkpoint tensor along `shard_dim`
    (None: the whole tensor) and writes it into parameter `param` (its slice `dst_index` of dim 0
    when set: one expert of stacked experts) at rows `dst_offset .. dst_offset + slice.shape[0]` of
    dim 0. Offsets are non-zero for fused parameters: q/k/v go into one `qkv_proj`, gate/up into one
    `gate_up_proj`. `broadcast`: a scale that may come as one value (per tensor: spread over the
    rows) or as one per row (`[rows]` or `[rows, 1]`).
    """

    param: str
    shard_dim: int | None
    full_shape: tuple[int, ...]
    dst_offset: int = 0
    dst_index: int | None = None
    broadcast: bool = False

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of this rank's slice of the checkpoint tensor."""
        shape = list(self.full_shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] //= tp_size
        return tuple(shape)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum partial results across the tensor-parallel group (the default process group)."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension, in rank order."""
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def local_shape(in_features: int, out_features: int, shard_dim: int, tp_size: int) -> list[int]:
    """`[out, in]` of one rank's shard (`shard_dim` 0: output rows, 1: input columns)."""
    full = (out_features, in_features)
    if full[shard_dim] % tp_size:
        raise ValueError(f"dimension {full[shard_dim]} is not divisible by tp_size {tp_size}")
    local = list(full)
    local[shard_dim] //= tp_size
    return local


class ShardedLinear(nn.Module):
    """A linear layer holding one rank's shard.

    `shard_dim` 0 splits output features (column parallel: no collective needed);
    `shard_dim` 1 splits input features (row parallel: outputs are summed across ranks).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_dim: int,
                 tp_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        local = local_shape(in_features, out_features, shard_dim, tp_size)
        self.shard_dim, self.tp_size = shard_dim, tp_size
        self.weight = nn.Parameter(torch.empty(local, dtype=dtype, device=device), requires_grad=False)
        bias_len = local[0]  # row-parallel bias is replicated and added once, after the sum
        self.bias = (nn.Parameter(torch.empty(bias_len, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard_dim == 0:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight), self.tp_size)
        return y if self.bias is None else y + self.bias


class VocabShardedEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split across ranks; lookups are summed."""

    def __init__(self, vocab_size: int, dim: int, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if vocab_size % tp_size:
            raise ValueError(f"vocab_size {vocab_size} is not divisible by tp_size {tp_size}")
        self.rows = vocab_size // tp_size
        self.start, self.tp_size = tp_rank * self.rows, tp_size
        self.weight = nn.Parameter(torch.empty(self.rows, dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp_size)
