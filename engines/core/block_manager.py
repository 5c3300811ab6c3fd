"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, full blocks shared by key.

A block holds `block_size` consecutive token positions of one sequence. A *full* block is keyed by a
stable hash of its tokens and of every token before it (the previous block's key), so two sequences
that start alike share those blocks instead of computing them again, and a continued request finds
the blocks its first engine filled. Blocks are reference-counted; a keyed block nobody uses stays
cached (and can be hit again) until an allocation needs room, then the least recently freed one is
evicted.

Three modes:
- own: the engine's own KV cache (`shared_kv: false`): blocks 1..N-1.
- parked: a standby over the rank's shared pool (daemon/kv_pool.py): only its slot's scratch blocks
  (its canary runs there), no prefix cache; it writes nothing anyone else reads.
- writer: the primary over the shared pool: the shared blocks, mirrored in the pool's index. A block
  is OWNED there before any step that writes it is launched, SEALED once the step that filled it
  completed, FREE once no step in flight can write it (engines/kv/publish.py). At promotion the
  writer adopts what the index holds: keyed blocks become its cache, and blocks the previous writer
  left OWNED are quarantined until that writer's processes are gone (`unquarantine`). A
  continuation whose last partial block the dead writer named as a tail copies it (`copies`, which
  the runner makes before the next step) and recomputes one token (engines/core/tail_publisher.py).
  With `integrity` (engines/kv/integrity.py), blocks a sequence is about to reuse (prefix hits and
  adopted blocks) are checked against their digests first: from the first that changed, the
  sequence recomputes, and that block is dropped from the cache and the index.

Block 0 is never handed out: CUDA-graph padding rows write their keys and values there.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Literal

import numpy as np

from daemon.kv_index import Adoption, BlockIndex

from wire.block_keys import ROOT, block_key, chain_keys
from engines.kv.adopted import AdoptedCache
from engines.kv.integrity import KVIntegrity
from engines.kv.publish import Publisher
from engines.kv.tails import AdoptedTails
from .sequence import Sequence

if TYPE_CHECKING:
    import torch

PAD_BLOCK = 0
Mode = Literal["own", "parked", "writer"]


def halves_of(keys: bytes) -> tuple[np.ndarray, np.ndarray]:
    """`halves` of many keys at once (joined), as two uint64 arrays."""
    both = np.frombuffer(keys, dtype="<u8").reshape(-1, 2)
    lo = both[:, 0].astype(np.uint64)
    lo[lo == 0] = 1
    return lo, both[:, 1].astype(np.uint64)


def halves(key: bytes) -> tuple[int, int]:
    """A key as the two 64-bit ints the block manager and the index hold (lo is never 0: 0 marks
    an unkeyed block)."""
    return int.from_bytes(key[:8], "little") or 1, int.from_bytes(key[8:], "little")


class BlockManager:
    """Owns the free lists, the reference counts and the prefix cache of one engine's KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 scratch: range | None = None, shared: range | None = None):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the padding block), got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.scratch = scratch if scratch is not None else range(0)
        self.shared = shared if shared is not None else range(1, num_blocks)
        self.mode: Mode = "own" if scratch is None else "parked"
        self.refs = [0] * num_blocks
        self.gens = [0] * num_blocks  # bumped at every allocation (the index's generation)
        self._scratch_free = list(reversed(self.scratch))
        self.free: list[int] = list(reversed(self.shared)) if self.mode == "own" else []  # pop(): low ids first
        # Keyed (cached) blocks: a block's key as two halves (lo 0 = not keyed); the cache is found by
        # lo, and a block matches only if hi agrees too (128 bits: no crafted prompt collides). Arrays:
        # a promotion sets every adopted block's key in one assignment.
        self.key_lo = np.zeros(num_blocks, np.uint64)
        self.key_hi = np.zeros(num_blocks, np.uint64)
        self.block_of: dict[int, int] = {}  # key lo -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced, oldest first
        self.quarantined: set[int] = set()
        self.adopted: AdoptedCache | None = None  # writer: keyed blocks found in the pool, not used yet
        self.tails: AdoptedTails | None = None  # writer: the tails the pool named when it took the role
        self.copies: list[tuple[int, int]] = []  # (source, destination) blocks to copy before the next step
        self.index: BlockIndex | None = None
        self.publisher: Publisher | None = None
        self.integrity: KVIntegrity | None = None  # writer: the blocks' digests, checked before reuse
        self._stamp = 1
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.on_continuation: Callable[[int, int], None] | None = None  # (reused, recomputed) tokens
        self.root = ROOT  # (DETERMINISTIC_ROOT in a deterministic engine)

    # ---- capacity --------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return len(self.scratch) if self.mode == "parked" else len(self.shared)

    @property
    def available(self) -> int:
        """Blocks an allocation can take now (free ones, then evictable cached ones)."""
        if self.mode == "parked":
            return len(self._scratch_free)
        return len(self.free) + len(self.evictable) + (self.adopted.count if self.adopted else 0)

    @property
    def used(self) -> int:
        return self.usable_blocks - self.available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- modes -----------------------------------------------------------------------------
    def become_writer(self, adoption: Adoption, index: BlockIndex, publisher: Publisher) -> None:
        """Take the shared blocks as the index describes them (the pool's writer role is ours)."""
        if any(self.refs[self.shared.start:self.shared.stop]):
            raise RuntimeError("a parked engine holds shared blocks: it cannot adopt the pool")
        self.mode, self.index, self.publisher = "writer", index, publisher
        start, n = self.shared.start, len(self.shared)
        self.gens[start:start + n] = adoption.gens.tolist()
        self.free = adoption.free[::-1].tolist()
        self.key_lo[adoption.sealed], self.key_hi[adoption.sealed] = adoption.key_lo, adoption.key_hi  # (parked:
        self.adopted = AdoptedCache(adoption, self.num_blocks)  # every other block is unkeyed already)
        self.block_of, self.evictable = {}, OrderedDict()
        self.quarantined = set(adoption.quarantined.tolist())
        self.tails = AdoptedTails(adoption.tails)
        self._stamp = adoption.next_stamp
        if self.integrity is not None:  # (the digests the index holds: the previous writer's, then ours)
            self.integrity.expected = index.digests

    def park(self) -> None:
        """Give the shared blocks up (every sequence that held some is gone): scratch only."""
        if any(self.refs[self.shared.start:self.shared.stop]):
            raise RuntimeError("sequences still hold shared blocks: hand them off before parking")
        self.mode, self.index, self.publisher, self.adopted, self.tails = "parked", None, None, None, None
        self.free, self.evictable, self.block_of = [], OrderedDict(), {}
        self.key_lo[:] = self.key_hi[:] = 0
        self.quarantined = set()
        if self.integrity is not None:
            self.integrity.expected = None

    def unquarantine(self) -> int:
        """The previous writer's processes are gone: the blocks it left unfinished are free, taken last
        (the tails among them stay whole for continuations that come later)."""
        blocks, self.quarantined = sorted(self.quarantined), set()
        for block in blocks:
            if self.index is not None:
                self.index.freed(block)
        self.free[:0] = blocks[::-1]  # (pop() takes from the end)
        return len(blocks)

    # ---- sequences -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks yet the cached blocks of its prompt's longest cached prefix.

        At least the prompt's last token is left to compute (its logits pick the first output token).
        A continued request always looks (its own blocks, from the engine that began it)."""
        prompt = seq.prompt_ids
        if self.mode != "parked" and (self.prefix_caching or seq.replayed):
            prev, n = self.root, (len(prompt) - 1) // self.block_size
            given = seq.prefix_keys if seq.prefix_keys is not None and len(seq.prefix_keys) == 16 * n else None
            for i in range(n):
                key = given[16 * i:16 * i + 16] if given is not None else \
                    block_key(prev, prompt[i * self.block_size:(i + 1) * self.block_size])
                lo, hi = halves(key)
                block = self.block_of.get(lo)
                if block is None or self.key_hi[block] != hi:
                    if self.adopted is not None and self.adopted.count:
                        self._match_adopted(seq, i, key, given)
                    break
                self._hit(seq, block, key)
                prev = key
        self._verify([seq])
        self._matched(seq)

    def _matched(self, seq: Sequence) -> None:
        """A sequence's cached prefix is found and verified (and a continuation's tail, if the pool named
        it): its counts."""
        self.queried_tokens += len(seq.prompt_ids)
        seq.num_computed = seq.num_cached = len(seq.block_table) * self.block_size + self._take_tail(seq)
        self.hit_tokens += seq.num_cached
        if seq.replayed and seq.first_scheduled is None and self.on_continuation is not None:
            self.on_continuation(seq.num_cached, len(seq.prompt_ids) - seq.num_cached)

    def _verify(self, seqs: list[Sequence]) -> None:
        """Keep the blocks each of `seqs` matched up to the first whose bytes changed since it was
        sealed (if one did): every changed one is dropped from the cache (freed in the index once no
        sequence holds it), and its sequences recompute from there. One digest call for all of them
        (a failover's continuations: one per layer per call, not per sequence)."""
        if self.integrity is None or self.integrity.expected is None:
            return
        seqs = [s for s in seqs if s.block_table]
        blocks = list(dict.fromkeys(b for s in seqs for b in s.block_table))
        bad = set(self.integrity.check(blocks)) if blocks else set()
        if not bad:
            return
        for block in bad:
            if self.block_of.get(int(self.key_lo[block])) == block:
                del self.block_of[int(self.key_lo[block])]
            self.key_lo[block] = self.key_hi[block] = 0
        for seq in seqs:
            good = next((i for i, b in enumerate(seq.block_table) if b in bad), None)
            if good is None:
                continue
            for block in reversed(seq.block_table[good:]):
                self._unref(block)
            del seq.block_table[good:]
            last = seq.block_table[-1] if good else None
            seq.keyed = good
            seq.last_key = None if last is None else \
                int(self.key_lo[last]).to_bytes(8, "little") + int(self.key_hi[last]).to_bytes(8, "little")

    def match_many(self, seqs: list[Sequence]) -> None:
        """`match_prefix` for continued sequences with no blocks yet, with one lookup for all, or for
        none of them (they are then matched one by one, as they are taken). A failover's continuations
        (256 at once, their keys given by the front end) each took ~45 us of the new primary's
        scheduler thread on the dev VM one by one, mostly numpy's per-call cost. Done at once only
        where the outcome is that of matching them in order: each finds its blocks among the adopted
        ones, and no two find the same block."""
        bs, adopted = self.block_size, self.adopted
        counts = [(len(s.prompt_ids) - 1) // bs for s in seqs]
        if (len(seqs) < 2 or self.mode != "writer" or adopted is None or not adopted.count
                or any(s.block_table or not s.replayed or s.prefix_keys is None or len(s.prefix_keys) != 16 * n
                       for s, n in zip(seqs, counts))
                or any(halves(s.prefix_keys[:16])[0] in self.block_of for s, n in zip(seqs, counts) if n)):
            return
        lo, hi = halves_of(b"".join([s.prefix_keys for s in seqs]))
        found = adopted.find(lo, hi)
        hits = np.sort(found[found >= 0])  # (not np.unique: its first call in a process took 15 ms on the dev VM)
        if (hits[1:] == hits[:-1]).any():
            return
        starts = np.cumsum([0] + counts[:-1])
        ends = starts + counts
        index = np.arange(len(found))
        misses = np.where(found < 0, index, len(found))
        runs = np.zeros(len(seqs), dtype=np.int64)
        some = np.flatnonzero(np.asarray(counts) > 0)
        if len(some):  # (a sequence's run: its blocks up to its first miss)
            runs[some] = np.minimum(np.minimum.reduceat(misses, starts[some]), ends[some]) - starts[some]
        taken = index - np.repeat(starts, counts) < np.repeat(runs, counts)
        adopted.take(found[taken])
        blocks, los = found.tolist(), lo.tolist()
        for seq, start, run in zip(seqs, starts.tolist(), runs.tolist()):
            self._give_adopted(seq, blocks[start:start + run], los[start:start + run],
                               seq.prefix_keys[16 * run - 16:16 * run])
        self._verify(seqs)
        for seq in seqs:
            self._matched(seq)

    def _take_tail(self, seq: Sequence) -> int:
        """A continuation whose prompt, past its full blocks, is a tail the pool named (or all but the
        last token of a keyed block): that block copied into a new last block (`copies`); returns
        how many positions it holds (0 if none)."""
        bs, prompt, n = self.block_size, seq.prompt_ids, len(seq.block_table)
        need = len(prompt) - 1 - n * bs  # (the last token is computed: its logits draw the next)
        if self.tails is None or not seq.replayed or not 0 < need < bs or not self.available:
            return 0
        ids = prompt[n * bs:n * bs + need + 1]
        ids = ids if isinstance(ids, list) else ids.tolist()
        last_key = seq.last_key if n else self.root
        parent = halves(last_key)
        source = self.tails.find(parent, ids[:need], self.gens)
        if source is None and need == bs - 1:  # its block was sealed before the writer died
            source = self._keyed_block(block_key(last_key, ids))
        if source is None:
            return 0
        ids = ids[:need]
        block = self._take(seq)
        # (its tail goes on: the next failover finds it too)
        self.index.tail_copied(block, *parent, ids)
        self.copies.append((source, block))
        seq.block_table.append(block)
        return need

    def _keyed_block(self, key: bytes) -> int | None:
        """The keyed block of `key`, in this writer's cache or adopted, if there is one."""
        lo, hi = halves(key)
        block = self.block_of.get(lo)
        if block is not None and int(self.key_hi[block]) == hi:
            return block
        if self.adopted is not None and self.adopted.count:
            found = int(self.adopted.find(np.array([lo], np.uint64), np.array([hi], np.uint64))[0])
            return found if found >= 0 else None
        return None

    def key_before(self, seq: Sequence, j: int) -> tuple[int, int] | None:
        """The key that `seq`'s block `j` follows, as halves: the root's, else its block j-1's (None
        where that is not known: a block computed twice keeps its key on the first)."""
        if j == 0:
            return halves(self.root)
        block = seq.block_table[j - 1]
        if lo := int(self.key_lo[block]):
            return lo, int(self.key_hi[block])
        return halves(seq.last_key) if seq.keyed == j and seq.last_key is not None else None

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def _hit(self, seq: Sequence, block: int, key: bytes) -> None:
        self._ref(block)
        seq.block_table.append(block)
        seq.keyed, seq.last_key = seq.keyed + 1, key

    def _match_adopted(self, seq: Sequence, first: int, key: bytes, given: bytes | None) -> None:
        """Blocks ``first``.. of the prompt from the adopted ones, looked up at once (a continuation's
        whole prompt is there); the matched ones become ordinary keyed blocks. ``given``: the prompt's
        keys, hashed by the front end (`prompt_keys`), else hashed here."""
        bs, prompt = self.block_size, seq.prompt_ids
        keys = given[16 * first:] if given is not None else \
            key + b"".join(chain_keys(key, prompt[(first + 1) * bs:(len(prompt) - 1) // bs * bs], bs))
        lo, hi = halves_of(keys)
        found = self.adopted.find(lo, hi)
        misses = np.flatnonzero(found < 0)
        n = int(misses[0]) if len(misses) else len(found)  # the leading run of matches
        blocks = found[:n]
        self.adopted.take(blocks)
        self._give_adopted(seq, blocks.tolist(), lo[:n].tolist(), keys[16 * n - 16:16 * n])

    def _give_adopted(self, seq: Sequence, blocks: list[int], los: list[int], last_key: bytes) -> None:
        """Adopted blocks (taken from the adopted cache) become `seq`'s next ones, keyed blocks of this
        writer's own cache (`last_key`: the last one's key)."""
        if not blocks:
            return
        self.block_of.update(zip(los, blocks))
        for block in blocks:  # (adopted blocks: no sequence holds them, none is evictable)
            self.refs[block] = 1
        seq.block_table.extend(blocks)
        seq.keyed, seq.last_key = seq.keyed + len(blocks), last_key

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence can hold `num_tokens` positions after allocating what it lacks."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.available

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Allocate blocks so the sequence holds `num_tokens` positions (check `can_grow` first)."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take(seq))

    def seal(self, seq: Sequence) -> None:
        """Key the blocks that are full now that their tokens are known (call after the step that
        computed them was launched and its input tokens read back). In the writer's index a block
        is SEALED once that step has completed on the device."""
        if self.mode == "parked" or (self.mode == "own" and not self.prefix_caching):
            return
        bs = self.block_size
        full = min(seq.num_computed, seq.num_tokens) // bs
        for i in range(seq.keyed, full):
            key = block_key(seq.last_key or self.root, seq.token_ids(i * bs, (i + 1) * bs))
            seq.keyed, seq.last_key = i + 1, key
            block = seq.block_table[i]
            lo, hi = halves(key)
            if lo in self.block_of or block in self.scratch:  # an identical block computed twice keeps the first
                continue
            self.block_of[lo] = block
            self.key_lo[block], self.key_hi[block] = lo, hi
            if self.publisher is not None:
                self.publisher.seal(block, self.gens[block], lo, hi, self._stamp)

    def release(self, seq: Sequence, handed_off: bool = False) -> None:
        """Drop the sequence's blocks (it finished, was aborted or preempted, or was `handed_off` to
        another engine: its tail stays named in the index, for its continuation)."""
        for block in reversed(seq.block_table):  # the tail is the least likely to be shared: evict it first
            self._unref(block, handed_off)
        seq.block_table, seq.keyed, seq.last_key = [], 0, None
        seq.num_computed = seq.num_cached = 0

    def _unref(self, block: int, handed_off: bool = False) -> None:
        """One holder of `block` let it go: unheld, it is cached (keyed) or free."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.scratch:
                self._scratch_free.append(block)
            elif self.key_lo[block]:
                self.evictable[block] = None
                if self.index is not None:
                    self.index.stamped(block, self._stamp)
                self._stamp += 1
            else:
                self.free.append(block)
                if self.publisher is not None:  # FREE once no step in flight can still write it
                    self.publisher.free(block, self.gens[block], handed_off)

    # ---- steps (the writer's index) --------------------------------------------------------
    def launched(self, done: torch.cuda.Event | None = None) -> None:
        """A step was launched (`done`: an event recorded after it): seals and frees asked for from
        now on wait for it."""
        if self.publisher is not None:
            self.publisher.launched(done)

    def publish_completed(self, waited: torch.cuda.Event | None = None) -> None:
        """Publish what completed steps sealed and freed (`waited`: the event of a step waited for)."""
        if self.publisher is not None:
            self.publisher.publish_completed(waited)

    # ---- blocks ----------------------------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def _take(self, seq: Sequence) -> int:
        """A block to append to `seq`'s blocks (its entry names the block before it: `prev`)."""
        if self.mode == "parked":
            block = self._scratch_free.pop()
        else:
            if self.free:
                block = self.free.pop()
            elif (block := self.adopted.evict() if self.adopted is not None else None) is not None:
                self.key_lo[block] = self.key_hi[block] = 0  # (older than anything released since)
            else:
                block, _ = self.evictable.popitem(last=False)
                del self.block_of[int(self.key_lo[block])]
                self.key_lo[block] = self.key_hi[block] = 0
            self.gens[block] += 1
            if self.index is not None:  # before the step that writes it is launched
                self.index.owned(block, self.gens[block], seq.block_table[-1] if seq.block_table else 0)
        self.refs[block] = 1
        return block
