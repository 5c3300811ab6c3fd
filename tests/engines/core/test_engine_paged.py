"""The serving core on the tiny checkpoint (fp32, CPU): paged KV blocks, token-budget steps with
chunked prefill, prefix caching, preemption when blocks run out, fair admission."""
from __future__ import annotations

import pytest

from engines.core.block_manager import BlockManager
from engines.core.sampling import SamplingParams
from engines.core.sequence import Sequence
from test_engine_units import make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(engine, n: int, length: int, seed: int = 0) -> list[list[int]]:
    from harness.bench.decode import random_prompts
    return random_prompts(n, length, engine.tokenizer.vocab_size, seed)


def run(engine, batch: list[list[int]], params: SamplingParams = GREEDY, group_of=None) -> list[Sequence]:
    """Submit every prompt at once and step to completion; returns the sequences."""
    seqs = [Sequence(p, params, engine.tokenizer, set(), engine.max_model_len, lambda o: None,
                     None if group_of is None else group_of(i)) for i, p in enumerate(batch)]
    for s in seqs:
        engine.scheduler.add(s)
    while engine.has_work:
        engine.step()
    return seqs


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy tokens of each prompt decoded alone, with a roomy cache and a large budget."""
    engine = make_engine(tiny_model, max_num_seqs=1, max_len=128, budget=512, prefix_caching=False)
    batch = prompts(engine, 6, 40) + prompts(engine, 2, 90, seed=1)
    return batch, [engine.generate([p], GREEDY)[0] for p in batch]


def test_chunked_prefill_gives_the_tokens_of_whole_prefill(tiny_model, reference) -> None:
    batch, want = reference
    engine = make_engine(tiny_model, max_num_seqs=8, max_len=128, budget=16, block_size=8, prefix_caching=False)
    seqs = run(engine, batch)
    assert [s.output_ids for s in seqs] == want
    assert engine.steps > sum(len(p) for p in batch) // 16  # a 90-token prompt really spanned several steps


def test_prefix_cache_hits_and_agrees_with_uncached(tiny_model, reference) -> None:
    batch, _ = reference
    system = batch[6][:64]  # a shared 64-token "system prompt" + distinct questions
    shared = [system + q[:12] for q in batch[:6]]
    cold = make_engine(tiny_model, max_num_seqs=4, max_len=128, block_size=8, prefix_caching=False)
    want = [s.output_ids for s in run(cold, shared)]
    engine = make_engine(tiny_model, max_num_seqs=4, max_len=128, block_size=8)
    first = run(engine, shared[:1])
    assert engine.blocks.hit_tokens == 0
    rest = run(engine, shared[1:])
    assert [s.output_ids for s in first + rest] == want
    assert engine.blocks.hit_tokens == 5 * 64  # every later request found the 8 full system blocks
    assert engine.stats()["prefix_queried_tokens"] == sum(len(p) for p in shared)
    # an identical prompt hits up to its last full block and still computes its last token
    hits = engine.blocks.hit_tokens
    again = run(engine, shared[:1])
    assert again[0].output_ids == want[0] and engine.blocks.hit_tokens - hits == (len(shared[0]) - 1) // 8 * 8


def test_block_exhaustion_preempts_and_every_request_completes(tiny_model, reference) -> None:
    batch, want = reference
    # 8 sequences of up to 102 tokens want ~100 blocks of 8; give them 40 (one is padding)
    per_block = make_engine(tiny_model, max_num_seqs=1, max_len=128).runner.model.kv_bytes_per_block(8)
    engine = make_engine(tiny_model, max_num_seqs=8, max_len=128, block_size=8, kv_bytes=40 * per_block,
                         prefix_caching=False)
    seqs = run(engine, batch)
    assert [s.output_ids for s in seqs] == want
    assert engine.scheduler.preemptions > 0
    assert engine.blocks.used == 0 and len(engine.blocks.free) == engine.blocks.usable_blocks


def test_packed_block_tables_follow_preemption_and_reordering(tiny_model, reference) -> None:
    """The runner rewrites only the new entries of a block table it packed before (engines/core/runner.py
    `_write_tables`): under preemption (a sequence gets a new table) and sequences finishing (rows
    shift), every packed row must still equal its sequence's table, in both pinned buffers."""
    batch, want = reference
    per_block = make_engine(tiny_model, max_num_seqs=1, max_len=128).runner.model.kv_bytes_per_block(8)
    engine = make_engine(tiny_model, max_num_seqs=8, max_len=128, block_size=8, kv_bytes=40 * per_block,
                         prefix_caching=False)
    runner, prepare, checked = engine.runner, engine.runner.prepare, []

    def checked_prepare(work, pending):  # noqa: ANN001, ANN202
        step = prepare(work, pending)
        tables = step.host.numpy()[:len(work) * runner.max_blocks].reshape(len(work), runner.max_blocks)
        for i, w in enumerate(work):
            assert tables[i, :len(w.seq.block_table)].tolist() == w.seq.block_table
        checked.append(len(work))
        return step
    runner.prepare = checked_prepare
    seqs = run(engine, batch)
    assert [s.output_ids for s in seqs] == want
    assert engine.scheduler.preemptions > 0 and len(checked) > 20


def test_a_request_with_many_prompts_takes_turns_with_others(tiny_model) -> None:
    """40 prompts of one request and 1 of another, 2 running at a time: the other request's
    sequence is admitted second, not 41st."""
    engine = make_engine(tiny_model, max_num_seqs=2, max_len=64)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    seqs = [Sequence(p, params, engine.tokenizer, set(), 64, lambda o: None, 1 if i == 40 else 0)
            for i, p in enumerate(prompts(engine, 41, 8))]
    for s in seqs:
        engine.scheduler.add(s)
    while seqs[40].num_computed == 0 and not seqs[40].output_ids:
        engine.step()
    started = [s for s in seqs[:40] if s.num_computed or s.output_ids]
    assert len(started) <= 2
    while engine.has_work:
        engine.step()
    assert all(len(s.output_ids) == 2 for s in seqs)


def test_block_manager_shares_refcounts_and_evicts_least_recent(tiny_model) -> None:
    from engines.core.tokenizer import Tokenizer
    tok = Tokenizer(tiny_model)
    bm = BlockManager(num_blocks=6, block_size=4)
    make = lambda ids: Sequence(ids, GREEDY, tok, set(), 64, lambda o: None)  # noqa: E731
    a = make(list(range(13)))
    bm.match_prefix(a)
    bm.grow(a, 13)
    a.num_computed = 13
    bm.seal(a)
    assert bm.used == 4 and bm.available == 1
    b = make(list(range(9)) + [99])
    bm.match_prefix(b)  # shares a's first two blocks (8 tokens); its last token is always computed
    assert b.block_table == a.block_table[:2] and b.num_cached == 8
    bm.release(a)
    assert bm.used == 2  # b still holds the shared two
    bm.release(b)
    assert bm.used == 0 and len(bm.evictable) == 3  # three full prompt blocks stay cached
    c = make([7] * 21)  # needs 6 blocks: takes the free one, then evicts every cached block
    assert not bm.can_grow(c, 21)
    bm.match_prefix(c)
    bm.grow(c, 20)
    assert bm.block_of == {} and bm.used == 5


def test_a_prefill_cap_beside_decode_rows_gives_the_same_tokens(tiny_model, reference) -> None:
    """Prompts that arrive while others decode are prefilled at most 8 tokens a step beside the decode
    rows (engines/core/scheduler.py prefill_cap): the same greedy tokens, in more steps."""
    batch, want = reference
    steps = []
    for cap in (None, 8):
        engine = make_engine(tiny_model, max_num_seqs=8, max_len=128, budget=64, block_size=8, prefix_caching=False)
        engine.scheduler.prefill_cap = cap
        early = [Sequence(p, GREEDY, engine.tokenizer, set(), engine.max_model_len, lambda o: None) for p in batch[:2]]
        for s in early:
            engine.scheduler.add(s)
        engine.step()  # (no decode row yet: the whole budget)
        late = [Sequence(p, GREEDY, engine.tokenizer, set(), engine.max_model_len, lambda o: None) for p in batch[2:]]
        for s in late:
            engine.scheduler.add(s)
        while engine.has_work:
            engine.step()
        assert [s.output_ids for s in early + late] == want
        steps.append(engine.steps)
    assert steps[1] > steps[0]  # (the capped run's prompts did span more steps)
