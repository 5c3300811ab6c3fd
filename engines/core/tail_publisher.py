"""A sequence's tail in the shared KV pool: its positions after its last full block.

Full blocks are SEALED and keyed; the last, partial block of a running sequence is not, so a stream
continued after a kill used to recompute it (up to `block_size - 1` tokens of every stream, and a
prefill step of a few thousand rows at a failover of 256 streams). With `kv_tails` on (off by
default: it costs the writer's scheduler thread time every step, about 5% of a small model's chat
throughput, bench/RESULTS.md 2026-12-05), the writer also names each sequence's tail in the pool's
index (daemon/kv_index.py): its token ids, the key it follows (the block before it), and how many
of its positions are complete. A new writer finds the tails the dead one named, and a
continuation whose prompt ends with one copies it into a block of its own (the dead writer's last
kernels may still be writing the positions after the complete ones) and recomputes one token: the
last one the client has, whose logits draw the next.

A planned handoff names every tail at once (`name_tails`, kv_tails or not): the engine has waited for
every step it launched, so a continuation on the next primary recomputes one token there too.

A tail also names the block before it: once SEALED, that block is taken whole by a continuation whose
client had not got all of it when the writer died. So does a block allocated but not yet written by a
completed step (its entry's `prev`, written at allocation): the writer may die in the step after a seal.

Only what completed is named: the positions a step computed are published once its sampled tokens
were read back (in the next step: it has completed on the device by then), before those tokens go
out to the client, and a tail's fill is written after its token ids and its parent key. A block
allocated again (its generation bumped) loses its tail first (`BlockIndex.owned`), and a row whose
block changed hands meanwhile is left out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from daemon.kv_index import TOKEN

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .scheduler import Scheduled
    from .sequence import Sequence


@dataclass
class _Recorded:
    """One launched step's rows, to be published once it has completed."""

    slots: np.ndarray  # the KV slot of every position it computed
    tokens: np.ndarray  # their token ids (as the index keeps them)
    q_lens: np.ndarray | None  # positions per row (None: one each, a decode step)
    blocks: np.ndarray  # each row's last block (its tail)
    fills: np.ndarray  # that block's positions complete once the step is
    gens: list[int]  # the blocks' generations when the step was launched
    began: list[tuple[int, int, int, int]]  # (row, block, parent lo, parent hi): tails begun


class TailPublisher:
    """The writer's side: record each launched step's positions, publish them once it completed.
    Per step, not per row: a decode step of 256 rows took 53-94 us of the scheduler thread on the
    dev VM, a third of what its seal loop took (bench/HISTORY.md, "The writer's cost per step")."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._recorded: _Recorded | None = None

    def record(self, work: list[Scheduled], slots: np.ndarray, tokens: np.ndarray, pending_rows: list[int],
               pending_src: list[int], in_order: bool, sampled_before: np.ndarray | None) -> None:
        """The step just launched computed `work` at KV `slots` with input `tokens` (its pending rows'
        tokens are `sampled_before[pending_src]`, the previous step's, read back since; `in_order`:
        both are 0..n-1, `Step.pending_in_order`). `work` is not empty."""
        b = self.blocks
        if b.mode != "writer":
            self._recorded = None
            return
        n = len(pending_rows)
        if in_order and n == len(tokens):  # (a decode step of the same rows as the last: the steady state)
            tokens = sampled_before[:n].astype(TOKEN)
        else:
            tokens = tokens.astype(TOKEN)
            if n:
                tokens[pending_rows] = sampled_before[pending_src]
        if len(slots) == len(work):  # one position a row
            q_lens, last = None, slots
        else:
            q_lens = np.fromiter((w.num_new for w in work), np.int64, len(work))
            last = slots[np.cumsum(q_lens) - 1]
        blocks, fills = np.divmod(last, b.block_size)
        fills += 1
        began = []
        for row in np.flatnonzero(fills <= (1 if q_lens is None else q_lens)).tolist():  # its tail's first position
            seq, j = work[row].seq, (work[row].start + work[row].num_new - 1) // b.block_size
            parent = b.key_before(seq, j)
            if parent is not None:
                began.append((row, int(blocks[row]), *parent))
        gens = b.gens
        self._recorded = _Recorded(slots.copy(), tokens, q_lens, blocks, fills, [gens[x] for x in blocks.tolist()],
                                   began)

    def publish(self) -> None:
        """The recorded step has completed on the device: name its rows' tails in the index."""
        rec, self._recorded = self._recorded, None
        b = self.blocks
        if rec is None or b.index is None:
            return
        gens = b.gens
        slots, tokens, blocks, fills, began = rec.slots, rec.tokens, rec.blocks, rec.fills, rec.began
        now = [gens[x] for x in blocks.tolist()]
        if now != rec.gens:  # some were allocated again since: another sequence's now
            keep = np.array(now) == np.array(rec.gens)
            at = keep if rec.q_lens is None else np.repeat(keep, rec.q_lens)
            slots, tokens, blocks, fills = slots[at], tokens[at], blocks[keep], fills[keep]
            began = [x for x in began if keep[x[0]]]
        b.index.tails_completed(slots, tokens, [x[1:] for x in began], blocks, fills)


def name_tails(blocks: BlockManager, seqs: list[Sequence]) -> int:
    """Name each sequence's tail at once, from what its steps computed (a planned handoff: the engine
    has waited for every step it launched); with or without `kv_tails`. Returns how many it named."""
    index, bs = blocks.index, blocks.block_size
    if index is None:
        return 0
    slots: list[int] = []
    tokens: list[int] = []
    tails, fills, began = [], [], []
    for seq in seqs:
        n = min(seq.num_computed, seq.num_tokens)
        j, fill = divmod(n, bs)
        parent = blocks.key_before(seq, j) if fill and j < len(seq.block_table) else None
        if parent is None:
            continue
        block = seq.block_table[j]
        slots += range(block * bs, block * bs + fill)
        tokens += seq.token_ids(j * bs, n)
        tails.append(block)
        fills.append(fill)
        began.append((block, *parent))
    if tails:
        index.tails_completed(np.array(slots), np.array(tokens, TOKEN), began, np.array(tails), np.array(fills))
    return len(tails)
