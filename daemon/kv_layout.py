"""KVLayout: the shape of one rank's shared KV pool, which the daemon allocates and every engine of the
rank views as its paged KV cache `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`.

Block ids: 0 is the padding block (CUDA-graph padding rows write there and nobody reads it), then
`scratch_blocks` per engine slot (a parked standby runs its canary there without touching the shared
blocks), then the shared blocks, which only the writer (the primary) allocates.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCRATCH_TOKENS = 512  # per engine slot: a parked standby's canary (prompt + max_tokens <= 64) fits
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVLayout(BaseModel):
    """Everything an engine must agree on to use a pool: a different value is a different pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_blocks: int = Field(ge=2)
    block_size: int = Field(ge=1)
    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    dtype: Literal["float32", "bfloat16", "float16"]
    scratch_slots: int = Field(ge=0)
    scratch_blocks: int = Field(ge=0)

    @property
    def bytes_per_block(self) -> int:
        """Every layer's keys and values of one block."""
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim * _ELEMENT_BYTES[self.dtype]

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def shared_start(self) -> int:
        """The first shared block (after the padding block and every slot's scratch)."""
        return 1 + self.scratch_slots * self.scratch_blocks

    @property
    def shared_blocks(self) -> range:
        return range(self.shared_start, self.num_blocks)

    def scratch(self, slot: int) -> range:
        """The scratch blocks of engine slot `slot`."""
        if not 0 <= slot < self.scratch_slots:
            raise ValueError(f"kv slot {slot} is outside the pool's {self.scratch_slots} slots")
        start = 1 + slot * self.scratch_blocks
        return range(start, start + self.scratch_blocks)


def scratch_blocks_for(block_size: int) -> int:
    return -(-SCRATCH_TOKENS // block_size)


def plan_layout(pool_bytes: int, block_size: int, layers: int, kv_heads: int, head_dim: int, dtype: str,
                scratch_slots: int) -> KVLayout:
    """As many blocks as `pool_bytes` holds; ValueError if that leaves no shared block."""
    probe = KVLayout(num_blocks=2, block_size=block_size, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, scratch_slots=scratch_slots, scratch_blocks=scratch_blocks_for(block_size))
    blocks = pool_bytes // probe.bytes_per_block
    if blocks <= probe.shared_start:
        raise ValueError(f"a KV pool of {pool_bytes} bytes holds {blocks} blocks of {probe.bytes_per_block} bytes, "
                         f"not more than the {probe.shared_start} reserved for padding and {scratch_slots} scratch "
                         f"slots of {probe.scratch_blocks} blocks: raise engines.kv_cache_bytes")
    return probe.model_copy(update={"num_blocks": blocks})
