"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, prefix blocks shared by hash.

A block holds `block_size` consecutive token positions of one sequence. A *full* prompt block is
keyed by a hash of its tokens and of every token before it (the previous block's key), so two
sequences whose prompts start alike share those blocks instead of computing them again. Blocks are
reference-counted; a cached block nobody uses stays in the cache (and can be hit again) until a new
allocation needs room, then the least recently freed one is evicted.

Block 0 is never handed out: CUDA-graph padding rows write their keys and values there.
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence

PAD_BLOCK = 0


def block_hash(prev: int | None, tokens: list[int]) -> int:
    """Key of a full block: its tokens and, through `prev`, everything before them."""
    return hash((prev, tuple(tokens)))


class BlockManager:
    """Owns the free list, the reference counts and the prefix cache of one engine's KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the padding block), got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.free: list[int] = list(range(num_blocks - 1, PAD_BLOCK, -1))  # pop() hands out low ids first
        self.refs = [0] * num_blocks
        self.key_of: dict[int, int] = {}  # block -> its hash, for full prompt blocks
        self.block_of: dict[int, int] = {}  # hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, oldest first
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ---- capacity --------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks an allocation can take now (free ones, then evictable cached ones)."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.usable_blocks - self.available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- sequences -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks yet the cached blocks of its prompt's longest cached prefix.

        At least the prompt's last token is left to compute (its logits pick the first output token).
        """
        prompt = seq.prompt_ids
        self.queried_tokens += len(prompt)
        if not self.prefix_caching:
            return
        prev = None
        for i in range((len(prompt) - 1) // self.block_size):
            key = block_hash(prev, prompt[i * self.block_size:(i + 1) * self.block_size])
            block = self.block_of.get(key)
            if block is None:
                break
            self._ref(block)
            seq.block_table.append(block)
            seq.block_keys.append(key)
            prev = key
        seq.num_computed = seq.num_cached = len(seq.block_table) * self.block_size
        self.hit_tokens += seq.num_cached

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence can hold `num_tokens` positions after allocating what it lacks."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.available

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Allocate blocks so the sequence holds `num_tokens` positions (check `can_grow` first)."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take())

    def register_full_blocks(self, seq: Sequence, computed: int) -> None:
        """Publish the prompt blocks that are full once `computed` positions hold their keys/values."""
        if not self.prefix_caching:
            return
        full = min(computed, len(seq.prompt_ids)) // self.block_size
        for i in range(len(seq.block_keys), full):
            prev = seq.block_keys[-1] if seq.block_keys else None
            key = block_hash(prev, seq.prompt_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_keys.append(key)
            block = seq.block_table[i]
            if key not in self.block_of:  # an identical block computed twice keeps the first
                self.block_of[key] = block
                self.key_of[block] = key

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's blocks (it finished, was aborted or preempted)."""
        for block in reversed(seq.block_table):  # the tail is the least likely to be shared: evict it first
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        seq.block_table, seq.block_keys = [], []
        seq.num_computed = seq.num_cached = 0

    # ---- blocks ----------------------------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
        self.refs[block] = 1
        return block
