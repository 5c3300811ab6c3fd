"""The shared KV pool's parts without engines: the block index (claims, crash consistency, distrust
of a bad index, the one-writer rule across processes) and the block manager's writer mode over it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from daemon.kv_index import (FREE, OWNED, SEALED, BlockIndex, FencedError, PreviousWriterAlive, _key_order,
                             checksum, index_bytes)
from daemon.kv_layout import KVLayout, plan_layout
from daemon.kv_pool import KVPool
from wire.block_keys import DETERMINISTIC_ROOT, block_key, chain_keys, prompt_keys
from engines.core.block_manager import BlockManager, halves, halves_of
from engines.kv.adopted import AdoptedCache
from engines.kv.publish import Publisher
from engines.core.sampling import SamplingParams
from engines.core.scheduler import Scheduler
from engines.core.sequence import Sequence
from engines.core.tokenizer import Tokenizer

FP = b"f" * 32
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def layout(blocks: int = 40) -> KVLayout:
    return KVLayout(num_blocks=blocks, block_size=4, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                    scratch_slots=2, scratch_blocks=3)


@pytest.fixture
def pool() -> KVPool:
    return KVPool(layout(), FP, torch.device("cpu"), rank=0)


def open_index(p: KVPool) -> BlockIndex:
    return BlockIndex(p.fds()[1], p.index_bytes, p.layout)


def state(index: BlockIndex, block: int) -> int:
    return int(index.entries[block]["word"]) & 0xFFFFFFFF


def test_plan_layout_reserves_padding_and_scratch() -> None:
    lay = plan_layout(300 * 128, 4, 1, 2, 2, "float32", scratch_slots=2)  # 128-byte blocks
    assert lay.num_blocks == 300 and lay.scratch_blocks == 128 and lay.shared_start == 257  # 512 tokens of 4
    with pytest.raises(ValueError, match="raise engines.kv_cache_bytes"):
        plan_layout(300 * 128, 4, 1, 2, 2, "float32", scratch_slots=3)  # 1 + 3 x 128 > 300 blocks
    assert layout().scratch(1) == range(4, 7) and layout().shared_start == 7


def test_claim_adopts_sealed_blocks_and_quarantines_owned_ones(pool: KVPool) -> None:
    a = open_index(pool)
    first = a.claim(pool.layout, FP)
    assert first.free.tolist() == list(range(7, 40)) and len(first.sealed) == 0 and a.epoch == 1
    a.owned(7, 1)
    a.sealed(7, 1, 5, 123 << 6, stamp=9)
    a.owned(8, 1)  # allocated, being written when the writer died: never reused as data
    b = open_index(pool)
    second = b.claim(pool.layout, FP)
    assert second.sealed.tolist() == [7] and (second.key_lo[0], second.key_hi[0]) == (5, 123 << 6)
    assert second.quarantined.tolist() == [8] and 8 not in second.free
    assert b.epoch == 2 and second.reset_reason is None


@pytest.mark.parametrize("corrupt,why", [
    (lambda e: e.__setitem__("gen", 99), "bad checksum"),  # a SEALED entry changed behind the writer's back
    (lambda e: e.__setitem__("word", 7), "state 7"),
    (lambda e: e.__setitem__("epoch", 50), "epoch 50"),  # from an epoch the pool never had
])
def test_a_corrupt_index_is_distrusted_and_emptied(pool: KVPool, corrupt, why: str) -> None:
    a = open_index(pool)
    a.claim(pool.layout, FP)
    a.owned(9, 1)
    a.sealed(9, 1, 77, 0, stamp=1)
    corrupt(a.entries[9])
    adoption = open_index(pool).claim(pool.layout, FP)
    assert why in adoption.reset_reason
    assert len(adoption.sealed) == 0 and len(adoption.quarantined) == 0 and 9 in adoption.free


def test_the_role_is_taken_before_the_pool_is_read_and_stays_taken_through_a_reset(pool: KVPool) -> None:
    """`take` (a promotion's answer) makes us the writer before anything is read; `adopt` reads what
    the last writer left, and a distrusted index, emptied, leaves the role ours at the same epoch."""
    a = open_index(pool)
    a.claim(pool.layout, FP)
    a.owned(9, 1)
    a.sealed(9, 1, 77, 0, stamp=1)
    a.owned(10, 1)
    b = open_index(pool)
    taken = b.take(pool.layout, FP)
    assert taken.epoch == b.epoch == 2 and int(b.header["writer_pid"]) == os.getpid()
    with pytest.raises(FencedError):
        a.owned(11, 1)  # the old writer is fenced by the take alone
    got = b.adopt(pool.layout, FP, taken)
    assert got.sealed.tolist() == [9] and got.quarantined.tolist() == [10] and got.reset_reason is None
    c = open_index(pool)
    taken = c.take(pool.layout, FP)
    c.entries[9]["gen"] = 99  # (a SEALED entry changed behind the writer's back)
    got = c.adopt(pool.layout, FP, taken)
    assert "bad checksum" in got.reset_reason and len(got.sealed) == 0 and 9 in got.free
    assert c.epoch == int(c.header["writer_epoch"]) == 3 and int(c.header["writer_pid"]) == os.getpid()
    c.owned(11, 1)  # still the writer after the reset


def test_a_peek_leaves_an_entry_mid_write_out_where_a_claim_distrusts_the_index(pool: KVPool) -> None:
    """A standby's peek reads beside the running writer: a SEALED entry with a bad checksum (being
    rewritten) is left out and the rest is read whole, sort included; a claim would distrust it."""
    a = open_index(pool)
    a.claim(pool.layout, FP)
    for block in (9, 10, 11):
        a.owned(block, 1)
        a.sealed(block, 1, 70 + block, 0, stamp=block)
    a.entries[10]["key_lo"] = 5  # (as if `sealed` were rewriting it: its word not stored yet)
    seen = open_index(pool).peek(pool.layout, FP)
    assert not isinstance(seen, str) and seen.sealed.tolist() == [9, 11] and seen.reset_reason is None
    assert 10 not in seen.free and seen.sort_s > 0
    assert "block 10 is SEALED with a bad checksum" in open_index(pool).claim(pool.layout, FP).reset_reason


def test_an_index_of_other_weights_or_layout_is_distrusted(pool: KVPool) -> None:
    a = open_index(pool)
    a.claim(pool.layout, FP)
    a.owned(9, 1)
    a.sealed(9, 1, 77, 0, stamp=1)
    other = open_index(pool).claim(pool.layout, b"g" * 32)
    assert "other weights" in other.reset_reason and len(other.sealed) == 0
    wider = layout().model_copy(update={"head_dim": 4})
    assert "head_dim" in open_index(pool).claim(wider, b"g" * 32).reset_reason


def test_a_key_sealed_twice_keeps_the_newest_block_and_frees_the_other(pool: KVPool) -> None:
    """Two writers may compute the same block (the second did not find the first's): both are whole."""
    a = open_index(pool)
    a.claim(pool.layout, FP)
    for block, stamp in ((9, 5), (10, 2)):
        a.owned(block, 1)
        a.sealed(block, 1, 77, 3, stamp=stamp)
    adoption = open_index(pool).claim(pool.layout, FP)
    assert adoption.reset_reason is None and adoption.sealed.tolist() == [9] and 10 in adoption.free


def test_adoption_sorts_keys_for_lookup_and_stamps_for_eviction(pool: KVPool) -> None:
    """Keys in random order (as blake2b's are), a lo half shared by two keys, and one key sealed
    twice: every distinct key found once, by key order; eviction goes oldest stamp first."""
    a = open_index(pool)
    a.claim(pool.layout, FP)
    rows = [(7, 900, 5, 4), (8, 100, 1, 2), (9, 900, 6, 9), (10, 300, 2, 1), (11, 100, 1, 7)]
    for block, lo, hi, stamp in rows:  # (blocks 8 and 11: one key; 7 and 9: lo clashes)
        a.owned(block, 1)
        a.sealed(block, 1, lo, hi, stamp=stamp)
    adoption = open_index(pool).claim(pool.layout, FP)
    assert adoption.key_lo.tolist() == [100, 300, 900, 900] and sorted(adoption.sealed.tolist()) == [7, 9, 10, 11]
    assert 8 in adoption.free  # the older of the twice-sealed key
    cache = AdoptedCache(adoption, pool.layout.num_blocks)
    assert [cache.evict() for _ in range(5)] == [10, 7, 11, 9, None]


def test_adopted_blocks_are_evicted_oldest_first_a_chunk_at_a_time(pool: KVPool, monkeypatch) -> None:
    """Eviction order is found a few blocks at a time (kv_adopted.AGE_CHUNK), never all at the
    promotion: across chunks it is still oldest stamp first, and blocks taken meanwhile are skipped."""
    import engines.kv.adopted as kv_adopted
    monkeypatch.setattr(kv_adopted, "AGE_CHUNK", 3)
    a = open_index(pool)
    a.claim(pool.layout, FP)
    blocks = list(pool.layout.shared_blocks)[:20]
    stamps = [(i * 7) % 20 + 1 for i in range(20)]  # (a permutation of 1..20)
    for i, (block, stamp) in enumerate(zip(blocks, stamps)):
        a.owned(block, 1)
        a.sealed(block, 1, 1000 + 17 * i, i, stamp=stamp)
    cache = AdoptedCache(open_index(pool).claim(pool.layout, FP), pool.layout.num_blocks)
    oldest_first = [b for _, b in sorted(zip(stamps, blocks))]
    cache.take(np.array(oldest_first[4:6]))
    assert [cache.evict() for _ in range(19)] == oldest_first[:4] + oldest_first[6:] + [None]


def test_the_key_order_is_the_lexsort_of_lo_hi_and_stamp() -> None:
    """Random halves, some lo halves repeated (with other or equal hi halves, other stamps)."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 1000, 70_000):
        lo = rng.integers(1, 2**63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2)
        hi = rng.integers(0, 4, n).astype(np.uint64)
        stamp = rng.permutation(n).astype(np.uint64)
        lo[: n // 10] = lo[n // 10: 2 * (n // 10)]
        want = np.lexsort((stamp, hi, lo))
        assert (_key_order(lo, hi, stamp) == want).all()


def test_a_continuations_keys_hashed_at_once_equal_the_block_by_block_keys() -> None:
    tokens = [(i * 7919) % 50_000 for i in range(16 * 9 + 5)]
    first = block_key(None, tokens[:16])
    chained, prev = [], first
    for i in range(1, 9):
        prev = block_key(prev, tokens[16 * i:16 * (i + 1)])
        chained.append(prev)
    assert chain_keys(first, tokens[16:16 * 9], 16) == chained
    lo, hi = halves_of(b"".join([first, *chained]))
    assert list(zip(lo.tolist(), hi.tolist())) == [halves(k) for k in [first, *chained]]


def test_one_writer_across_processes(pool: KVPool) -> None:
    """A live writer blocks any claim; once it gives the role up (or is gone) the claim succeeds,
    and the old writer's next write is refused (FencedError), not applied."""
    fd = pool.fds()[1]
    child = textwrap.dedent(f"""
        import sys
        from daemon.kv_index import BlockIndex, PreviousWriterAlive
        from daemon.kv_layout import KVLayout
        lay = KVLayout.model_validate_json(sys.argv[1])
        try:
            BlockIndex({fd}, {pool.index_bytes}, lay).claim(lay, {FP!r}, wait_s=0.2)
            print("claimed")
        except PreviousWriterAlive as e:
            print("refused:", e)
    """)
    run = lambda: subprocess.run([sys.executable, "-c", child, pool.layout.model_dump_json()], pass_fds=(fd,),  # noqa: E731
                                 capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    a = open_index(pool)
    a.claim(pool.layout, FP)
    out = run()
    assert out.stdout.startswith("refused:") and "still runs" in out.stdout, out.stderr
    a.release()
    assert run().stdout.strip() == "claimed"
    with pytest.raises(FencedError):
        a.owned(9, 1)
    assert state(a, 9) == FREE


def test_block_keys_are_stable_across_processes() -> None:
    tokens = list(range(100, 116))
    here = block_key(block_key(None, tokens), tokens)
    there = subprocess.run([sys.executable, "-c", "from wire.block_keys import block_key; t = list(range(100, 116)); "
                            "print(block_key(block_key(None, t), t).hex())"], capture_output=True, text=True, timeout=60)
    assert bytes.fromhex(there.stdout.strip()) == here and len(here) == 16


def writer(p: KVPool, prefix_caching: bool = True) -> tuple[BlockManager, BlockIndex]:
    lay = p.layout
    bm = BlockManager(lay.num_blocks, lay.block_size, prefix_caching, scratch=lay.scratch(0), shared=lay.shared_blocks)
    index = open_index(p)
    bm.become_writer(index.claim(lay, FP), index, Publisher(index, bm.gens, torch.device("cpu")))
    return bm, index


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


def seq_of(tok: Tokenizer, ids: list[int], replayed: int = 0) -> Sequence:
    return Sequence(ids, GREEDY, tok, set(), 64, lambda o: None, replayed=replayed)


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """`s` admitted, given its blocks, all of its prompt computed and its full blocks sealed."""
    bm.match_prefix(s)
    bm.grow(s, len(s.prompt_ids))
    s.num_computed = len(s.prompt_ids)
    bm.seal(s)
    return s


def test_parked_engine_uses_its_scratch_only(pool: KVPool, tok: Tokenizer) -> None:
    lay = pool.layout
    bm = BlockManager(lay.num_blocks, lay.block_size, scratch=lay.scratch(1), shared=lay.shared_blocks)
    s = seq_of(tok, list(range(9)))
    bm.match_prefix(s)
    bm.grow(s, 9)
    assert s.block_table == [4, 5, 6] and bm.available == 0 and bm.usable_blocks == 3
    s.num_computed = 9
    bm.seal(s)
    assert bm.block_of == {}  # a parked engine keys nothing: nobody else reads its blocks


def test_writer_mirrors_every_block_in_the_index(pool: KVPool, tok: Tokenizer) -> None:
    bm, index = writer(pool)
    s = seq_of(tok, list(range(10)))
    bm.match_prefix(s)
    bm.grow(s, 10)
    full, partial = s.block_table[:2], s.block_table[2]
    assert all(state(index, b) == OWNED for b in s.block_table)  # before any step writes them
    s.num_computed = 10
    bm.seal(s)  # on cpu a step has completed when it returns: sealed at once
    assert [state(index, b) for b in full] == [SEALED, SEALED] and state(index, partial) == OWNED
    bm.release(s)
    assert state(index, partial) == FREE and set(bm.evictable) == set(full)
    e = index.entries[full[0]]
    assert int(e["word"]) >> 32 == checksum(int(e["key_lo"]), int(e["key_hi"]), int(e["gen"]), int(e["epoch"]))


class StepEvent:
    """Stands in for the CUDA event a launched step names (engines/kv/publish.py): whether the step
    has completed, and how often the publisher asked."""

    def __init__(self) -> None:
        self.completed, self.queries = False, 0

    def query(self) -> bool:
        self.queries += 1
        return self.completed


def test_a_seal_waits_for_its_step_and_the_step_waited_for_publishes_with_no_query(pool: KVPool) -> None:
    """On a GPU a seal is published once its step completed: through the step the engine waited for
    (and every step before it) without asking the device, else as far as queries find them done."""
    index = open_index(pool)
    index.claim(pool.layout, FP)
    gens = [1] * pool.layout.num_blocks
    publisher = Publisher(index, gens, torch.device("cuda"))  # (no CUDA call: every step names its event)
    first, second, third = StepEvent(), StepEvent(), StepEvent()
    for block, step in ((10, first), (11, second), (12, third)):
        index.owned(block, 1)
        publisher.launched(step)
        publisher.seal(block, 1, block, block, stamp=1)
    publisher.publish_completed()
    assert [state(index, b) for b in (10, 11, 12)] == [OWNED] * 3 and first.queries == 1
    publisher.publish_completed(waited=second)
    assert [state(index, b) for b in (10, 11, 12)] == [SEALED, SEALED, OWNED]
    assert (first.queries, second.queries, third.queries) == (1, 0, 0)
    third.completed = True
    publisher.publish_completed(waited=StepEvent())  # an event it has no writes behind: it queries
    assert state(index, 12) == SEALED and third.queries == 1


def test_a_new_writer_continues_from_the_blocks_and_waits_to_reuse_unfinished_ones(pool: KVPool, tok: Tokenizer) -> None:
    old, _ = writer(pool)
    s = computed(old, seq_of(tok, list(range(13))))  # 3 full blocks sealed; the 4th is OWNED when the writer dies
    unfinished = s.block_table[3]
    new, index = writer(pool)
    assert new.quarantined == {unfinished} and unfinished not in new.free
    cont = seq_of(tok, list(range(13)), replayed=5)  # the same tokens: a continuation
    reused = []
    new.on_continuation = lambda r, c: reused.append((r, c))
    new.match_prefix(cont)
    assert cont.block_table == s.block_table[:3] and reused == [(12, 1)]
    assert new.unquarantine() == 1 and unfinished in new.free and state(index, unfinished) == FREE


def test_continuations_find_their_blocks_even_without_prefix_caching(pool: KVPool, tok: Tokenizer) -> None:
    old, _ = writer(pool, prefix_caching=False)
    s = computed(old, seq_of(tok, list(range(9))))
    new, _ = writer(pool, prefix_caching=False)
    other = seq_of(tok, list(range(9)))
    new.match_prefix(other)
    assert other.num_cached == 0  # a new request: no prefix cache
    cont = seq_of(tok, list(range(9)), replayed=2)
    new.match_prefix(cont)
    assert cont.num_cached == 8


def test_adopted_blocks_are_used_by_key_and_evicted_oldest_first(pool: KVPool, tok: Tokenizer) -> None:
    """A promotion keeps what it found as arrays (engines/kv/adopted.py): a continuation takes its
    blocks by key; allocations take free blocks, then adopted ones (oldest first), then its own."""
    old, _ = writer(pool)
    seqs = [seq_of(tok, [i] * 4 + list(range(100, 109))) for i in range(3)]  # 3 full blocks each
    tables = []
    for s in seqs:
        computed(old, s)
        tables.append(s.block_table[:3])
        old.release(s)  # its tail first: the oldest stamps are seqs[0]'s last blocks
    new, _ = writer(pool)
    assert new.adopted.count == 9 and len(new.block_of) == 0 and new.available == new.usable_blocks
    cont = seq_of(tok, seqs[1].prompt_ids, replayed=4)
    new.match_prefix(cont)
    assert cont.num_cached == 12 and new.adopted.count == 6 and len(new.block_of) == 3
    new.release(cont)
    hog = seq_of(tok, list(range(500, 500 + 4 * (len(new.free) + 2))))
    new.match_prefix(hog)
    new.grow(hog, len(hog.prompt_ids))  # every free block, then the two oldest adopted ones
    assert new.adopted.count == 4 and [bool(new.adopted.live[b]) for b in tables[0]] == [True, False, False]
    again = seq_of(tok, seqs[1].prompt_ids, replayed=4)
    new.match_prefix(again)
    assert again.num_cached == 12  # its blocks were used, so kept: the oldest unused went first


def test_index_bytes_grow_with_the_pool() -> None:
    assert index_bytes(1000, 16) - index_bytes(0, 16) == 1000 * (88 + 16 * 4)  # an entry, a block's token ids


def test_a_continuation_takes_its_cached_head_then_adopted_blocks_up_to_the_first_missing(pool: KVPool,
                                                                                           tok: Tokenizer) -> None:
    ids = list(range(100, 121))  # 21 tokens: blocks 0-4 full (the last token is left to compute)
    keys, prev = [], None
    for i in range(5):
        prev = block_key(prev, ids[4 * i:4 * i + 4])
        keys.append(prev)
    a = open_index(pool)
    a.claim(pool.layout, FP)
    for block, i in ((10, 0), (11, 1), (12, 2), (14, 4)):  # block 3's key is missing: the chain is torn there
        lo, hi = halves(keys[i])
        a.owned(block, 1)
        a.sealed(block, 1, lo, hi, stamp=i + 1)
    bm, _ = writer(pool)
    head = seq_of(tok, ids[:5])
    bm.match_prefix(head)  # block 0 from the adopted ones...
    assert head.block_table == [10]
    bm.release(head)  # ... now the new writer's own cached block
    s = seq_of(tok, ids, replayed=8)
    bm.match_prefix(s)  # block 0 from its cache, 1-2 adopted, none past the missing block 3
    assert s.block_table == [10, 11, 12] and (s.keyed, s.last_key) == (3, keys[2]) and s.num_cached == 12
    assert [bm.refs[b] for b in (10, 11, 12)] == [1, 1, 1] and bm.adopted.count == 1  # block 14 stays adopted


def test_a_deterministic_writer_takes_no_block_a_default_one_left(pool: KVPool, tok: Tokenizer) -> None:
    """Its kernels give other bits: its key chains start at another root, so nothing matches."""
    a, _ = writer(pool)
    s = computed(a, seq_of(tok, list(range(9))))
    a.publisher.launched()
    a.publisher.flush()
    b, _ = writer(pool)
    b.root = DETERMINISTIC_ROOT
    again = seq_of(tok, list(range(9)))
    b.match_prefix(again)
    assert again.num_cached == 0 and b.adopted.count == 2  # (both of a's full blocks are in the pool, unused)
    c, _ = writer(pool)
    same = seq_of(tok, list(range(9)))
    c.match_prefix(same)
    assert same.num_cached == 8  # a default writer finds them


@pytest.mark.parametrize("given", ["front end's", "wrong length", "none"])
def test_a_continuation_matches_the_same_blocks_with_its_keys_hashed_by_the_front_end(pool: KVPool, tok: Tokenizer,
                                                                                       given: str) -> None:
    """The front end hashes a continuation's prompt keys beside the core (block_manager.prompt_keys):
    the same keys as the core's own, so the same blocks; keys of another length are not trusted."""
    ids = list(range(100, 121))  # blocks 0-4 full before the last token
    old, _ = writer(pool)
    head = computed(old, seq_of(tok, ids[:9]))  # blocks 0-1 keyed, in the old writer's own cache...
    s = computed(old, seq_of(tok, ids))  # ... and all five of the full prompt
    new, _ = writer(pool)
    new.match_prefix(again := seq_of(tok, ids[:9], replayed=2))  # block 0 moves into the new writer's cache
    keys = prompt_keys(ids, new.root, new.block_size)
    assert len(keys) == 16 * 5 and (s.keyed, s.last_key) == (5, keys[-16:])  # (a chain: the last key sums it up)
    hint = {"front end's": keys, "wrong length": keys[:-16] + b"x" * 16 + keys[-16:], "none": None}[given]
    cont = Sequence(ids, GREEDY, tok, set(), 64, lambda o: None, replayed=8, prefix_keys=hint)
    new.match_prefix(cont)
    assert cont.block_table == s.block_table[:5] and (cont.keyed, cont.last_key) == (5, s.last_key)
    assert cont.num_cached == 20
    assert head.block_table[:2] == again.block_table[:2] == s.block_table[:2]


def test_with_the_heap_keeping_freed_memory_a_rehearsed_claim_takes_no_page_fault() -> None:
    """engines/core/heap.py: after one read of the index (a parked standby's rehearsal), a claim of a
    pool of 65k keyed blocks touches almost no new page (its own process: the
    allocator policy is global)."""
    child = textwrap.dedent("""
        import random, sys, torch
        from daemon.kv_index import BlockIndex, _faults
        from daemon.kv_layout import KVLayout
        from daemon.kv_pool import KVPool
        from engines.core.heap import keep_freed_memory
        assert keep_freed_memory()
        lay = KVLayout(num_blocks=65536, block_size=16, layers=1, kv_heads=1, head_dim=2, dtype="float32",
                       scratch_slots=2, scratch_blocks=32)
        pool = KVPool(lay, b"f" * 32, torch.device("cpu"), 0)
        writer = BlockIndex(pool.fds()[1], pool.index_bytes, lay)
        writer.claim(lay, b"f" * 32)
        rng = random.Random(0)
        for block in lay.shared_blocks:
            writer.owned(block, 1)
            writer.sealed(block, 1, rng.getrandbits(63) | 1, rng.getrandbits(64), stamp=block)
        standby = BlockIndex(pool.fds()[1], pool.index_bytes, lay)
        standby.peek(lay, b"f" * 32)
        writer.release()
        before = _faults()
        adoption = standby.claim(lay, b"f" * 32)
        print(len(adoption.sealed), _faults() - before, adoption.sort_faults)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    adopted, faults, sort_faults = map(int, out.stdout.split())
    assert adopted > 65000 and faults <= 64 and sort_faults <= 16, out.stdout  # (without: ~735, the sort ~127)


def _continuations(tok: Tokenizer, prompts: list[list[int]], root: bytes) -> list[Sequence]:
    return [Sequence(ids, GREEDY, tok, set(), 64, lambda o: None, replayed=2, prefix_keys=prompt_keys(ids, root, 4))
            for ids in prompts]


def _outcome(bm: BlockManager, seqs: list[Sequence]) -> tuple:
    return ([(s.block_table, s.keyed, s.last_key, s.num_cached, s.num_computed) for s in seqs], list(bm.refs),
            dict(bm.block_of), bm.adopted.count, bm.adopted.live.tolist(), bm.hit_tokens, bm.queried_tokens)


def test_a_failovers_continuations_matched_at_once_find_what_one_by_one_would(pool: KVPool, tok: Tokenizer) -> None:
    """block_manager.match_many: one lookup for many continuations, the outcome of matching them in
    order (a chain that ends before the prompt does, a prompt of no full block, one not in the pool)."""
    old, _ = writer(pool)
    done = [list(range(100, 113)), list(range(200, 209)), list(range(300, 317))]
    for ids in done:
        computed(old, seq_of(tok, ids))
    prompts = [done[0] + [7] * 8, done[1], [1, 2, 3], done[2], list(range(400, 409))]
    one_by_one, _ = writer(pool)
    seqs = _continuations(tok, prompts, one_by_one.root)
    reports: list[list] = [[], []]
    one_by_one.on_continuation = lambda r, c: reports[0].append((r, c))
    for s in seqs:
        one_by_one.match_prefix(s)
    want = _outcome(one_by_one, seqs)
    at_once, _ = writer(pool)
    at_once.on_continuation = lambda r, c: reports[1].append((r, c))
    seqs = _continuations(tok, prompts, at_once.root)
    at_once.match_many(seqs)
    assert _outcome(at_once, seqs) == want and reports[0] == reports[1]
    assert [s.num_cached for s in seqs] == [12, 8, 0, 16, 0]


@pytest.mark.parametrize("why", ["two share a block", "one finds its head cached", "one has no keys"])
def test_continuations_that_must_be_matched_in_order_are_left_to_the_scheduler(pool: KVPool, tok: Tokenizer,
                                                                                why: str) -> None:
    """Where matching at once could differ from matching in order, match_many matches none: the
    scheduler then matches each as it takes it."""
    old, _ = writer(pool)
    for ids in (list(range(100, 113)), list(range(200, 209))):
        computed(old, seq_of(tok, ids))
    new, _ = writer(pool)
    prompts = [list(range(100, 113)), list(range(100, 109)) if why == "two share a block" else list(range(200, 209))]
    if why == "one finds its head cached":
        new.match_prefix(head := seq_of(tok, list(range(200, 205)), replayed=1))
        new.release(head)
    seqs = _continuations(tok, prompts, new.root)
    if why == "one has no keys":
        seqs[1].prefix_keys = None
    new.match_many(seqs)
    assert [s.block_table for s in seqs] == [[], []]
    sched = Scheduler(new, max_num_seqs=8, max_num_batched_tokens=64)
    for s in seqs:
        sched.add(s)
    sched.schedule()
    assert [s.num_cached for s in seqs] == [12, 8]


def test_continuations_matched_at_once_verify_their_blocks_in_one_digest_call(pool: KVPool, tok: Tokenizer) -> None:
    """The KV integrity check of a failover's continuations (engines/kv/integrity.py): one digest call
    for all of them, not one per sequence (48 layers x 64 sequences took 200 ms of an H100 engine's
    first step), with the outcome of checking them one by one: the sequence holding a block changed
    since it was sealed recomputes from it, the others keep theirs."""
    from engines.kv.integrity import KVIntegrity
    lay = pool.layout
    layers = [torch.randn(2, lay.num_blocks, lay.block_size, 2, 4) for _ in range(3)]

    def checked_writer() -> BlockManager:
        bm = BlockManager(lay.num_blocks, lay.block_size, True, scratch=lay.scratch(0), shared=lay.shared_blocks)
        bm.integrity = KVIntegrity(layers)
        index = open_index(pool)
        bm.become_writer(index.claim(lay, FP), index, Publisher(index, bm.gens, torch.device("cpu"), bm.integrity))
        return bm
    old = checked_writer()
    done = [list(range(100, 113)), list(range(200, 209)), list(range(300, 317))]
    sealed = [computed(old, seq_of(tok, ids)) for ids in done]
    old.publish_completed(None)
    layers[1][0, sealed[2].block_table[1]] += 1.0  # noise over one block of the third
    outcomes, calls, mismatches = [], [], []
    for at_once in (True, False):  # (the first drops the changed block from the index: the second never finds it)
        bm = checked_writer()
        real = bm.integrity.digests
        bm.integrity.digests = lambda blocks, real=real: calls.append(len(blocks)) or real(blocks)
        seqs = _continuations(tok, done, bm.root)
        if at_once:
            bm.match_many(seqs)
            assert calls == [sum((len(ids) - 1) // lay.block_size for ids in done)]  # (every full block at once)
        else:
            for s in seqs:
                bm.match_prefix(s)
        outcomes.append(_outcome(bm, seqs)[0])  # (what each sequence holds; the cache beyond differs: the index)
        mismatches.append(bm.integrity.mismatches)
    assert outcomes[0] == outcomes[1] and mismatches == [1, 0]
    assert [s.num_cached for s in seqs] == [12, 8, 4]
