"""A sequence's tail (its positions past its last full block) named in the shared pool's index, and a
new writer's continuation taking it (engines/core/tail_publisher.py): what is named, when, and what is never
taken. The engine-level check (a SIGKILL mid-stream, the continuation exact and one token
recomputed, on one rank and under TP) is in tests/engines/kv/test_shared_kv_engine.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from daemon.kv_index import BlockIndex
from daemon.kv_pool import KVPool
from wire.block_keys import block_key
from engines.core.block_manager import BlockManager, halves
from engines.core.tail_publisher import TailPublisher, name_tails
from engines.core.scheduler import Scheduled
from engines.core.sequence import Sequence
from engines.core.tokenizer import Tokenizer
from test_shared_kv_units import FP, layout, open_index, seq_of, writer

BS = 4
PROMPT = list(range(100, 110))  # 10 tokens: blocks 0-1 full, a tail of 2 in block 2


@pytest.fixture
def pool() -> KVPool:
    return KVPool(layout(), FP, torch.device("cpu"), rank=0)


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


def step(bm: BlockManager, tails: TailPublisher | None, rows: list[tuple[Sequence, int, int]],
         publish: bool = True) -> None:
    """One step computing `rows` (sequence, start, positions), as LLMEngine.step runs it: blocks
    grown, launched, full blocks sealed, the positions recorded (`tails`; None: kv_tails off); then
    (`publish`) completed."""
    work = []
    for s, start, n in rows:
        bm.grow(s, start + n)
        s.num_computed = start + n
        work.append(Scheduled(s, start, n))
    slots = np.array([s.block_table[p // BS] * BS + p % BS for s, start, n in rows for p in range(start, start + n)])
    ids = np.array([t for s, start, n in rows for t in s.token_ids(start, start + n)])
    for w in work:
        bm.seal(w.seq)
    if tails is not None:
        tails.record(work, slots, ids, [], [], True, None)
        if publish:
            tails.publish()


def stream(bm: BlockManager, tails: TailPublisher | None, s: Sequence, outputs: list[int]) -> None:
    """`s`'s prompt past its cached head in one step, then one decode step per output token."""
    bm.match_prefix(s)
    step(bm, tails, [(s, s.num_computed, len(s.prompt_ids) - s.num_computed)])
    for t in outputs:
        s.output_ids.append(t)
        step(bm, tails, [(s, s.num_tokens - 1, 1)])


def continuation(tok: Tokenizer, ids: list[int], replayed: int) -> Sequence:
    return seq_of(tok, ids, replayed=replayed)


def successor(pool: KVPool) -> tuple[BlockManager, BlockIndex, list]:
    """The next writer (the previous one is taken as fenced: same process), and its continuations'
    (reused, recomputed) reports."""
    bm, index = writer(pool)
    reports: list = []
    bm.on_continuation = lambda reused, recomputed: reports.append((reused, recomputed))
    return bm, index, reports


def streamed(pool: KVPool, tok: Tokenizer) -> tuple[BlockManager, BlockIndex, Sequence, int]:
    """A writer that streamed PROMPT + [7, 8, 9, 5, 6] (positions 0-14 computed: 12-14 in block 3),
    and that sequence's tail block."""
    bm, index = writer(pool)
    s = seq_of(tok, list(PROMPT))
    stream(bm, TailPublisher(bm), s, [7, 8, 9, 5, 6])
    return bm, index, s, s.block_table[3]


def test_a_continuation_ending_on_a_full_block_needs_no_tail(pool: KVPool, tok: Tokenizer) -> None:
    bm, _ = writer(pool)
    stream(bm, TailPublisher(bm), seq_of(tok, list(PROMPT)), [7, 8, 9])  # positions 0-12 computed
    new, _, reports = successor(pool)
    c = continuation(tok, PROMPT + [7, 8, 9], replayed=3)
    new.match_prefix(c)
    assert c.num_computed == 12 and new.copies == [] and reports == [(12, 1)]  # blocks 0-2 keyed


def test_a_tail_is_copied_to_a_block_of_its_own(pool: KVPool, tok: Tokenizer) -> None:
    _, index, s, tail = streamed(pool, tok)
    assert int(index.entries[tail]["fill"]) == 3 and index.tokens[tail, :3].tolist() == [9, 5, 6]
    new, _, reports = successor(pool)
    assert tail in new.quarantined
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)
    new.match_prefix(c)
    assert c.num_computed == c.num_cached == 14 and reports == [(14, 1)]
    assert new.copies == [(tail, c.block_table[3])] and c.block_table[3] != tail  # never written in place
    assert c.block_table[:3] == s.block_table[:3]  # the keyed blocks, adopted
    assert new.take_copies() == [(tail, c.block_table[3])] and new.copies == []


@pytest.mark.parametrize("outputs,ids,why", [
    ([7, 8, 9, 5, 6], PROMPT + [7, 8, 9, 4, 6], "another token in the tail"),
    ([7, 8, 9, 5, 6], PROMPT[:-1] + [0, 7, 8, 9, 5, 6], "another parent: the same tail tokens after another block"),
    ([7, 8, 9, 5], PROMPT + [7, 8, 9, 5, 6, 1], "more positions than the tail holds complete (2 of 3)"),
])
def test_a_tail_that_does_not_hold_the_continuations_tokens_is_not_taken(pool: KVPool, tok: Tokenizer,
                                                                         outputs: list[int], ids: list[int],
                                                                         why: str) -> None:
    bm, _ = writer(pool)
    tails = TailPublisher(bm)
    stream(bm, tails, seq_of(tok, list(PROMPT)), outputs)  # a tail [9, 5, 6] (or [9, 5]) after block 2
    stream(bm, tails, seq_of(tok, PROMPT[:-1] + [0]), [7, 8])  # another block 2, keyed, and no tail
    new, _, reports = successor(pool)
    c = continuation(tok, ids, replayed=len(ids) - 10)
    new.match_prefix(c)
    assert new.copies == [] and c.num_computed == 12, why  # its keyed blocks, and no tail
    assert reports == [(12, len(ids) - 12)]


def test_a_step_not_completed_names_nothing_and_a_block_allocated_again_loses_its_tail(pool: KVPool,
                                                                                        tok: Tokenizer) -> None:
    bm, index = writer(pool)
    tails = TailPublisher(bm)
    s = seq_of(tok, list(PROMPT))
    bm.match_prefix(s)
    step(bm, tails, [(s, 0, 10)], publish=False)  # launched, never completed: the writer died
    tail = s.block_table[2]
    assert int(index.entries[tail]["fill"]) == 0
    tails.publish()
    assert int(index.entries[tail]["fill"]) == 2
    bm.release(s)  # it finished: its tail is no one's to continue
    bm.publisher.flush()
    assert int(index.entries[tail]["fill"]) == 0

    t = seq_of(tok, list(PROMPT))
    bm.match_prefix(t)
    step(bm, tails, [(t, 8, 2)], publish=False)  # positions 8-9 again (the head was cached)
    again = t.block_table[2]
    bm.release(t)
    u = seq_of(tok, [1, 2, 3])
    bm.match_prefix(u)
    bm.grow(u, 3)
    assert u.block_table == [again]  # allocated again before the step that named it completed
    assert int(index.entries[again]["fill"]) == 0
    tails.publish()  # that row is left out: the block is u's now
    assert int(index.entries[again]["fill"]) == 0 and int(index.entries[again]["parent_lo"]) == 0


def test_a_handed_off_sequence_keeps_its_tail_for_the_next_writer(pool: KVPool, tok: Tokenizer) -> None:
    bm, index, s, tail = streamed(pool, tok)
    bm.release(s, handed_off=True)
    bm.publisher.flush()
    assert int(index.entries[tail]["fill"]) == 3  # FREE, its tail still named
    new, _, reports = successor(pool)
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)
    new.match_prefix(c)
    assert reports == [(14, 1)] and new.copies == [(tail, c.block_table[3])]


def test_a_handoff_names_every_tail_at_once_without_the_steps_tails(pool: KVPool, tok: Tokenizer) -> None:
    """kv_tails off: no step named a tail; the handoff names each sequence's (the one with a full last
    block has none) and a continuation on the next writer recomputes one token."""
    bm, index = writer(pool)
    s, whole = seq_of(tok, list(PROMPT)), seq_of(tok, list(range(200, 208)))  # a tail of 3; two full blocks
    stream(bm, None, s, [7, 8, 9, 5, 6])
    stream(bm, None, whole, [])
    assert int(index.entries[s.block_table[3]]["fill"]) == 0
    assert name_tails(bm, [s, whole, seq_of(tok, [1, 2])]) == 1  # (the last: never computed)
    tail = s.block_table[3]
    bm.release(s, handed_off=True)
    bm.publisher.flush()
    assert int(index.entries[tail]["fill"]) == 3
    new, _, reports = successor(pool)
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)
    new.match_prefix(c)
    assert reports == [(14, 1)] and new.copies == [(tail, c.block_table[3])]


def test_a_tail_whose_block_was_allocated_again_is_not_taken(pool: KVPool, tok: Tokenizer) -> None:
    *_, tail = streamed(pool, tok)
    new, _, reports = successor(pool)
    new.unquarantine()  # the dead writer is gone: its unfinished blocks are free again
    hog = seq_of(tok, [1, 2, 3])
    new.match_prefix(hog)
    while tail not in hog.block_table:  # until the tail's block is someone else's
        new.grow(hog, len(hog.block_table) * BS + 1)
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)
    new.match_prefix(c)
    assert new.copies == [] and reports == [(12, 3)]


def test_a_writer_killed_before_a_tails_fill_is_stored_leaves_only_what_the_fill_covers(pool: KVPool,
                                                                                     tok: Tokenizer) -> None:
    _, index, _, tail = streamed(pool, tok)
    index.entries[tail]["fill"] = 2  # position 14's token is stored, its fill is not (the last store)
    new, _, reports = successor(pool)
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6, 1], replayed=6)  # needs positions 12-14 complete
    new.match_prefix(c)
    assert new.copies == [] and reports == [(12, 4)]


def test_a_block_allocated_by_a_later_writer_names_no_tail(pool: KVPool, tok: Tokenizer) -> None:
    bm, index, s, tail = streamed(pool, tok)
    bm.release(s, handed_off=True)
    second, _, _ = successor(pool)
    assert len(second.tails) == 2  # the tail, and the sealed block before it (block 2)
    index.epoch = 0  # (the first writer's handle: fenced)
    second.index.owned(tail, second.gens[tail] + 1)  # the second writer takes the block for another sequence
    third, _, _ = successor(pool)
    assert len(third.tails) == 0


@pytest.mark.parametrize("more,why", [([], "its copied tail, still partial"), ([3], "its block, sealed since")])
def test_a_stream_continued_twice_finds_its_last_block_again(pool: KVPool, tok: Tokenizer, more: list[int],
                                                              why: str) -> None:
    """The tail a continuation copied goes on as its own: at the next failover it is named (its first
    positions came from the copy, not from a step) or, once full, keyed; either is taken."""
    bm, _ = writer(pool)
    stream(bm, TailPublisher(bm), seq_of(tok, list(PROMPT)), [7, 8, 9, 5, 6])
    second, _, _ = successor(pool)
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)
    stream(second, TailPublisher(second), c, more)  # position 14 computed (and 15)
    copied = c.block_table[3]
    assert second.copies[0][1] == copied
    second.unquarantine()  # the first writer is gone: its tail, copied, is no one's now
    third, _, reports = successor(pool)
    again = continuation(tok, PROMPT + [7, 8, 9, 5, 6, 3], replayed=6)  # its client got 3
    third.match_prefix(again)
    assert reports == [(15, 1)] and third.copies == [(copied, again.block_table[3])], why


def test_a_continuation_after_the_fence_still_finds_its_tail(pool: KVPool, tok: Tokenizer) -> None:
    """The dead writer's blocks, free once its processes are gone, are taken last: a continuation
    admitted after other sequences took blocks still finds its tail whole."""
    bm, _ = writer(pool)
    stream(bm, TailPublisher(bm), seq_of(tok, list(PROMPT)), [7, 8, 9, 5, 6])
    new, _, reports = successor(pool)
    new.unquarantine()
    other = seq_of(tok, [1, 2, 3, 4, 5])
    new.match_prefix(other)
    new.grow(other, 5)  # two blocks
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)
    new.match_prefix(c)
    assert reports[-1] == (14, 1)


def test_a_claim_names_only_tails_with_a_parent_and_a_fill_within_the_block(pool: KVPool, tok: Tokenizer) -> None:
    """Entries a writer never wrote as a tail (no parent, a fill past the block, or SEALED) are
    not tails, whatever their other fields hold: a malformed index never lends a continuation its
    keys and values."""
    _, index, _, tail = streamed(pool, tok)
    free = [b for b in range(pool.layout.shared_start, pool.layout.num_blocks) if b != tail][-3:]
    for block, fill, parent in zip(free, (BS + 1, 2, 0), (5, 0, 5)):  # past the block, no parent, no fill
        index.entries[block]["fill"], index.entries[block]["parent_lo"] = fill, parent
    sealed = int(np.flatnonzero((index.entries["word"] & 0xFFFFFFFF) == 2)[0])
    index.entries[sealed]["fill"], index.entries[sealed]["parent_lo"] = 2, 5
    new, _, _ = successor(pool)
    parent = block_key(block_key(block_key(None, PROMPT[:4]), PROMPT[4:8]), PROMPT[8:] + [7, 8])  # block 2's key
    assert len(new.tails) == 2 and new.tails.find(halves(parent), [9, 5, 6], new.gens) == tail  # (and block 2)


def test_a_continuation_whose_client_lagged_behind_a_sealed_block_takes_that_block(pool: KVPool,
                                                                                   tok: Tokenizer) -> None:
    """The writer completed and sealed block 3 and began block 4, while the client had got only two
    of block 3's tokens: the tail in block 4 names block 3 (`prev`), whose positions are whole."""
    bm, _ = writer(pool)
    s = seq_of(tok, list(PROMPT))
    stream(bm, TailPublisher(bm), s, [7, 8, 9, 5, 6, 1, 2])  # positions 0-16: block 3 full, 16 in block 4
    assert s.keyed == 4
    new, _, reports = successor(pool)
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)  # positions 12-13 of block 3 needed
    new.match_prefix(c)
    assert reports == [(14, 1)] and new.copies == [(s.block_table[3], c.block_table[3])]


def test_a_block_sealed_just_before_the_writer_died_is_found_through_the_block_after_it(pool: KVPool,
                                                                                        tok: Tokenizer) -> None:
    """The writer sealed block 3 and launched the step writing position 16 (block 4 allocated), then
    died before that step completed: block 4 names no tail yet, but its entry names block 3 (`prev`,
    written at allocation), so a client that had got two of block 3's tokens still takes it whole."""
    bm, _ = writer(pool)
    tails = TailPublisher(bm)
    s = seq_of(tok, list(PROMPT))
    stream(bm, tails, s, [7, 8, 9, 5, 6, 1])  # positions 0-15: block 3 full and sealed
    s.output_ids.append(2)
    step(bm, tails, [(s, 16, 1)], publish=False)  # block 4 allocated, its step never completed
    assert s.keyed == 4 and len(s.block_table) == 5
    new, _, reports = successor(pool)
    c = continuation(tok, PROMPT + [7, 8, 9, 5, 6], replayed=5)  # positions 12-13 of block 3 needed
    new.match_prefix(c)
    assert reports == [(14, 1)] and new.copies == [(s.block_table[3], c.block_table[3])]


def test_a_first_block_allocated_names_no_block_before_it(pool: KVPool, tok: Tokenizer) -> None:
    """A sequence's first block has no block before it: its entry's `prev` is 0, whatever the block's
    last user left there, so a claim takes no sealed block through it."""
    bm, index = writer(pool)
    block = bm.free[-1]
    index.entries[block]["prev"] = pool.layout.shared_start + 1  # (left by an earlier life)
    s = seq_of(tok, list(PROMPT))
    bm.grow(s, 1)
    assert s.block_table == [block] and int(index.entries[block]["prev"]) == 0
