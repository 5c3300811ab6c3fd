"""The step's composition (engines/core/scheduler.py): decode rows first, and beside them at most
`prefill_cap` prefill tokens, a failover's continuations aside; a step with no decode row spends its
whole budget."""
from __future__ import annotations

import pytest

from engines.core.block_manager import BlockManager
from engines.core.sampling import SamplingParams
from engines.core.scheduler import Scheduler
from engines.core.sequence import Sequence
from engines.core.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


def seq(tok: Tokenizer, n: int, first: int = 1, replayed: int = 0) -> Sequence:
    return Sequence([first + i for i in range(n)], GREEDY, tok, set(), 512, lambda o: None, replayed=replayed)


def decoding(sched: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    """`seqs` running with their prompts computed and one sampled token: their next step is decode rows."""
    for s in seqs:
        sched.add(s)
    sched.schedule()
    for s in seqs:
        s.output_ids.append(7)
        assert s.total_len - s.num_computed == 1
    return seqs


def scheduler(cap: int | None) -> Scheduler:
    return Scheduler(BlockManager(256, 16, prefix_caching=False), max_num_seqs=16, max_num_batched_tokens=256,
                     prefill_cap=cap)


def test_beside_decode_rows_a_step_adds_at_most_the_cap_of_prefill_tokens(tok: Tokenizer) -> None:
    sched = scheduler(48)
    runs = decoding(sched, [seq(tok, 10, 100 + 20 * i) for i in range(3)])
    long, short = seq(tok, 100, 1000), seq(tok, 30, 2000)
    sched.add(long)
    sched.add(short)
    step = sched.schedule()
    assert [(w.seq, w.num_new) for w in step] == [(runs[0], 1), (runs[1], 1), (runs[2], 1), (long, 48)]
    for s in runs:
        s.output_ids.append(8)
    step = sched.schedule()  # the long prompt's next chunk (it runs now), then nothing left for the short one
    assert [(w.seq, w.num_new) for w in step if w.num_new > 1] == [(long, 48)]
    assert short not in sched.running


def test_with_no_decode_row_a_step_spends_its_whole_budget(tok: Tokenizer) -> None:
    sched = scheduler(48)
    a, b = seq(tok, 100, 1000), seq(tok, 100, 2000)
    sched.add(a)
    sched.add(b)
    assert [(w.seq, w.num_new) for w in sched.schedule()] == [(a, 100), (b, 100)]


def test_a_continuation_is_never_held_back_by_the_cap(tok: Tokenizer) -> None:
    sched = scheduler(8)
    [run] = decoding(sched, [seq(tok, 10, 100)])
    cont = [seq(tok, 40, 1000 + 100 * i, replayed=5) for i in range(3)]
    new = seq(tok, 40, 5000)
    for s in [*cont, new]:
        sched.add(s)
    step = sched.schedule()
    assert [(w.seq, w.num_new) for w in step] == [(run, 1), *[(c, 40) for c in cont], (new, 8)]


def test_no_cap_is_the_budget(tok: Tokenizer) -> None:
    sched = scheduler(None)
    [run] = decoding(sched, [seq(tok, 10, 100)])
    new = seq(tok, 200, 1000)
    sched.add(new)
    assert [(w.seq, w.num_new) for w in sched.schedule()] == [(run, 1), (new, 200)]
