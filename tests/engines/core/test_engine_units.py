"""In-process engine parts on the tiny checkpoint: tokenizer, sampler, stop rules, continuous batching."""
from __future__ import annotations

import time

import pytest
import torch

from daemon.loader import load_checkpoint_into
from engines.core.engine import LLMEngine
from models import build_model, read_model_args
from engines.core.runner import KVBudgetError, ModelRunner
from engines.core.sampling import Sampler, SamplingParams, ensure_seed
from engines.core.sequence import Sequence
from engines.core.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

PROMPTS = ["The quick brown fox", "Hello", "In a hole in the ground there lived", "a b c d e f g", "Once upon"]


def make_engine(model_dir, max_num_seqs: int = 8, max_len: int = 128, kv_bytes: int = 1 << 26,
                block_size: int = 16, budget: int = 256, prefix_caching: bool = True) -> LLMEngine:
    args = read_model_args(model_dir)
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    load_checkpoint_into(model, model_dir)
    runner = ModelRunner(model, torch.device("cpu"))
    runner.allocate_kv_cache(kv_bytes, block_size, max_len, max_num_seqs, budget)
    return LLMEngine(runner, Tokenizer(model_dir), max_len, max_num_seqs, prefix_caching=prefix_caching)


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


# ---- tokenizer ------------------------------------------------------------------------------
def test_bos_added_once_as_the_checkpoint_says(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode(tok.bos_token + "Hello world").count(tok.bos_token_id) == 1
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token_ids == {tok.tok.token_to_id("<|end_of_text|>"), tok.tok.token_to_id("<|im_end|>")}


def test_chat_template_renders_roles_and_generation_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|begin_of_text|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_chat_template_errors_are_chat_template_errors(tiny_model, tmp_path) -> None:
    import json
    import shutil
    for f in ("tokenizer.json", "config.json"):
        shutil.copy(tiny_model / f, tmp_path / f)
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    t = Tokenizer(tmp_path)
    with pytest.raises(ChatTemplateError, match="first must be user"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_incremental_detokenizer_waits_for_whole_characters(tok: Tokenizer) -> None:
    text = "naïve café 日本語 ✓ done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_streams_bytes_that_never_form_a_character(tok: Tokenizer) -> None:
    """A looping model's run of lead bytes: each is final (U+FFFD) once the next arrives, so the text
    streams as it comes instead of waiting for the end."""
    lead = tok.tok.token_to_id("\u00e2")  # the byte 0xE2 alone (a 3-byte character's start), byte-level
    a = tok.encode("a", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    assert [detok.add(lead) for _ in range(4)] == ["", "\ufffd", "\ufffd", "\ufffd"]
    assert "".join(detok.add(i) for i in a) == "\ufffda"
    assert [detok.add(lead) for _ in range(2)] == ["", "\ufffd"]


# ---- sampler --------------------------------------------------------------------------------
def test_sampler_greedy_topk1_and_tiny_topp_all_pick_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.5, top_p=1e-6), SamplingParams(temperature=0.7, top_k=1, top_p=0.5)]
    for i, p in enumerate(params):
        p.seed = i
    assert Sampler()(logits, params, [5, 6, 7, 8]).tolist() == logits.argmax(-1).tolist()


def test_sampler_seed_reproducible_and_topk_respected() -> None:
    logits = torch.zeros(1, 100)
    logits[0, :5] = torch.tensor([5.0, 4.9, 4.8, 4.7, 4.6])
    p = SamplingParams(temperature=1.0, top_k=3, seed=7)
    draws = [Sampler()(logits, [p], [11])[0].item() for _ in range(3)]
    assert len(set(draws)) == 1, "same seed and position must give the same token"
    many = {Sampler()(logits, [p], [pos])[0].item() for pos in range(200)}
    assert many <= {0, 1, 2} and len(many) > 1


def test_sampler_draw_is_a_function_of_seed_and_position_only() -> None:
    """Same (seed, position): same token, whatever the batch holds or in which row; other seeds
    or positions draw differently; frequencies follow the softmax."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen)
    params = [ensure_seed(SamplingParams(temperature=0.9, top_p=0.95)) for _ in range(6)]
    params[2] = SamplingParams(temperature=0)
    positions = [3, 40, 7, 7, 1000, 2**40]
    batch = Sampler()(logits, params, positions).tolist()
    alone = [Sampler()(logits[i:i + 1], [params[i]], [positions[i]]).item() for i in range(6)]
    assert batch == alone and batch[2] == logits[2].argmax().item()
    rev = Sampler()(logits.flip(0), params[::-1], positions[::-1]).tolist()
    assert rev[::-1] == batch
    row = logits[:1].expand(4000, -1)
    p = SamplingParams(temperature=1.0, seed=12345)
    draws = Sampler()(row, [p] * 4000, list(range(4000)))
    freq = torch.bincount(draws, minlength=300).float() / 4000
    probs = logits[0].softmax(-1)
    assert (freq - probs).abs().max() < 0.03, "Gumbel-max must sample the softmax"
    other = Sampler()(row, [SamplingParams(temperature=1.0, seed=54321)] * 4000, list(range(4000)))
    assert (other != draws).float().mean() > 0.5


# ---- sequences and batching -----------------------------------------------------------------
def test_stop_string_cut_and_held_back(tok: Tokenizer) -> None:
    outs = []
    seq = Sequence([tok.bos_token_id], SamplingParams(max_tokens=50, stop=["brown f"]), tok, set(), 1000, outs.append)
    for t in tok.encode("the quick brown fox jumps", add_special_tokens=False):
        seq.append(t)
        if seq.finish_reason:
            break
    assert seq.finish_reason == "stop"
    assert "".join(o.delta for o in outs) == "the quick "
    assert outs[-1].finish_reason == "stop" and all(o.finish_reason is None for o in outs[:-1])


def test_stop_string_found_after_released_text_is_dropped(tok: Tokenizer) -> None:
    """A sequence keeps only TEXT_KEPT chars of released text (engines/core/sequence.py): a stop string
    thousands of chars in, split across tokens, is still cut exactly and nothing is lost or repeated."""
    from engines.core.sequence import TEXT_KEPT
    text = " ".join(f"word{i}" for i in range(800)) + " the quick brown fox jumps"
    assert len(text) > 3 * TEXT_KEPT
    outs = []
    seq = Sequence([tok.bos_token_id], SamplingParams(max_tokens=100_000, stop=["brown f"]), tok, set(), 100_000,
                   outs.append)
    for t in tok.encode(text, add_special_tokens=False):
        seq.append(t)
        if seq.finish_reason:
            break
    assert seq.finish_reason == "stop"
    assert "".join(o.delta for o in outs) == text[:text.index("brown f")]
    assert len(seq._text) < TEXT_KEPT + 200


def test_every_token_is_an_output_its_text_empty_or_not(tok: Tokenizer) -> None:
    """A greedy loop on one lead byte (a random model's) streams a U+FFFD a token, and a special
    token (no text) is an Output all the same: a client sees every token, not a silence."""
    lead = tok.tok.token_to_id("\u00e2")
    outs = []
    seq = Sequence([tok.bos_token_id], SamplingParams(max_tokens=8, ignore_eos=True), tok, {tok.bos_token_id}, 1000,
                   outs.append)
    for t in [lead] * 5 + [tok.bos_token_id] * 3:
        seq.append(t)
    assert [o.delta for o in outs] == ["", *["\ufffd"] * 4, "", "", ""]  # (the last byte may still complete)
    assert [o.token_ids for o in outs] == [[t] for t in [lead] * 5 + [tok.bos_token_id] * 3]
    assert seq.finish_reason == "length" and outs[-1].finish_reason == "length"


def test_stop_token_ids_and_max_tokens(tok: Tokenizer) -> None:
    outs = []
    seq = Sequence([0], SamplingParams(max_tokens=3, stop_token_ids=[42]), tok, set(), 1000, outs.append)
    seq.append(7)
    seq.append(42)
    assert seq.finish_reason == "stop" and outs[-1].completion_tokens == 2
    seq2 = Sequence([0], SamplingParams(max_tokens=2), tok, set(), 1000, lambda o: None)
    seq2.append(7)
    seq2.append(8)
    assert seq2.finish_reason == "length"


def test_batched_and_unbatched_greedy_tokens_match(tiny_model) -> None:
    engine = make_engine(tiny_model, max_num_seqs=8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = [engine.generate([p], params)[0] for p in prompts]
    together = engine.generate(prompts, params)
    assert together == alone
    assert all(len(t) == 24 for t in together)


def test_requests_join_and_leave_between_steps_and_reuse_blocks(tiny_model) -> None:
    """Two running at most, five staggered requests of different lengths: same tokens as one at a time."""
    engine = make_engine(tiny_model, max_num_seqs=2)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    lengths = [5, 17, 9, 12, 3]
    alone = [engine.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
             for p, n in zip(prompts, lengths)]
    seqs = []
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        seq = Sequence(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), engine.tokenizer, set(),
                       engine.max_model_len, lambda o: None)
        engine.scheduler.add(seq)
        seqs.append(seq)
        for _ in range(i + 1):  # the next request arrives while earlier ones are mid-decode
            engine.step()
        assert len(engine.scheduler.running) <= 2
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == alone
    assert engine.blocks.used == 0  # every block is free or only cached


def test_kv_budget_too_small_is_a_clear_error(tiny_model) -> None:
    args = read_model_args(tiny_model)
    runner = ModelRunner(build_model(args, device="meta"), torch.device("cpu"))
    with pytest.raises(KVBudgetError, match="kv_cache_bytes=65536 cannot hold one sequence of max_model_len=1024"):
        runner.allocate_kv_cache(65536, 16, 1024, 4, 256)


def test_greedy_picks_flag_non_finite_rows_and_guarded_sample_fails_only_them() -> None:
    """A NaN or inf row reads back -1 and feeds token 0 to the next step; the other rows, greedy or
    sampled, keep their draw (engines/core/sample_guard.py)."""
    from engines.core.sample_guard import greedy_picks, guarded_sample
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    picks = greedy_picks(logits)
    assert picks.tolist() == [int(logits[0].argmax()), -1, int(logits[2].argmax()), -1]
    greedy = SamplingParams(temperature=0)
    tokens, read_back, errors = guarded_sample(Sampler(), logits, picks, [greedy] * 4, [5] * 4)
    assert tokens.tolist() == [picks[0], 0, picks[2], 0] and read_back.tolist() == picks.tolist() and not errors
    hot = SamplingParams(temperature=1.0, seed=3)
    tokens, read_back, errors = guarded_sample(Sampler(), logits, picks, [greedy, hot, hot, greedy], [5] * 4)
    assert read_back.tolist()[1] == -1 and read_back.tolist()[3] == -1 and tokens.tolist()[1] == 0
    assert read_back[0] == picks[0] and read_back[2] == Sampler()(logits[2:3], [hot], [5])[0]


def test_output_rows_rebuild_the_output() -> None:
    """The core link sends `Output.to_row()`; the front end rebuilds with `Output(*row)`."""
    import dataclasses
    from engines.core.sequence import Output
    out = Output(7, "héllo", "stop", 12, 3, [4, 5, 6], "why", (0.25, 0.5))
    assert Output(*out.to_row()) == out and len(out.to_row()) == len(dataclasses.fields(Output))


@pytest.mark.parametrize("stop", [[], ["ing"], ["\n\n", "the end of the story"]])
def test_a_continued_sequence_emits_what_the_uninterrupted_one_would_at_every_cut(tok: Tokenizer, stop) -> None:
    """A continuation replays only the tail of the tokens it was given (engines/core/sequence.py
    `_replay`): at every cut point its text and finish are the uninterrupted sequence's, also with
    stop strings and characters split across byte-level tokens."""
    import random
    rng = random.Random(5)
    prompt = tok.encode("Once upon a time")
    vocab = tok.tok.get_vocab_size()
    gen = [rng.randrange(3, vocab) for _ in range(120)] + tok.encode(" singing the end of the story")[1:]
    params = SamplingParams(max_tokens=len(gen), temperature=0, stop=stop, ignore_eos=True)

    def run(ids: list[int], replayed: int, rest: list[int]) -> tuple[str, str | None]:
        outs = []
        seq = Sequence(ids, params, tok, set(), 4096, outs.append, replayed=replayed)
        for t in rest:
            seq.append(t)
            if seq.finish_reason:
                break
        return "".join(o.delta for o in outs), seq.finish_reason

    whole, _ = run(prompt, 0, gen)
    for cut in range(1, len(gen), 7):
        before, finished = run(prompt, 0, gen[:cut])
        if finished:
            break
        after, reason = run(prompt + gen[:cut], cut, gen[cut:])
        assert before + after == whole, (cut, stop)


def test_the_preflights_shape_arithmetic_agrees_with_building_the_model(tiny_model):
    """supervisor/preflight.py checks TP shapes and KV bytes without torch (models/args.py):
    what it says must be what building the model says."""
    import torch

    from models import build_model, read_model_args
    from models.args import kv_bytes_per_block, tp_problem
    base = read_model_args(tiny_model)
    for changes in ({}, {"num_key_value_heads": 1, "num_attention_heads": 4}, {"intermediate_size": 30},
                    {"vocab_size": 511}):
        args = base.model_copy(update=changes)
        for tp in (1, 2, 3, 4):
            try:
                model = build_model(args, tp_size=tp, dtype=torch.bfloat16)
            except ValueError:
                assert tp_problem(args, tp) is not None, (changes, tp)
                continue
            assert tp_problem(args, tp) is None, (changes, tp)
            assert kv_bytes_per_block(args, tp, 16, "bfloat16") == model.kv_bytes_per_block(16), (changes, tp)


def test_coalescing_for_a_slow_reader_keeps_the_scheduled_marker_first():
    """Outputs queued behind a busy client are merged per choice, but the scheduled marker (the
    router's proof that the request ran here) is never merged away."""
    from engines.core.sequence import Output
    from engines.frontend.streams import _coalesce
    marker = Output(7, "", None, 4, 0)
    a, b = Output(7, "he", None, 4, 1, [1]), Output(7, "llo", None, 4, 2, [2])
    got = _coalesce([(0, marker), (0, a), (0, b)])
    assert got[0] == (0, marker) and got[0][1].is_scheduled
    assert [(i, o.delta, o.token_ids) for i, o in got[1:]] == [(0, "hello", [1, 2])]


def test_a_continued_sequence_waits_behind_preempted_ones_only(tok: Tokenizer) -> None:
    """A stream another engine began never queues behind a request that arrived during the
    failover: the waiting order is preempted, continued (in arrival order), then the fair queue."""
    from engines.core.scheduler import FairQueue
    q = FairQueue(ahead=8)
    new = [Sequence([1, 2], SamplingParams(max_tokens=2), tok, set(), 64, lambda o: None) for _ in range(2)]
    cont = [Sequence([1, 2, 3], SamplingParams(max_tokens=2), tok, set(), 64, lambda o: None, replayed=1)
            for _ in range(2)]
    preempted = Sequence([4, 5], SamplingParams(max_tokens=2), tok, set(), 64, lambda o: None)
    for s in (new[0], cont[0], new[1], cont[1]):
        q.push(s)
    q.push_front(preempted)
    assert list(q) == [preempted, *cont, *new] and len(q) == 5
    assert q.remove(cont[1]) and not q.remove(cont[1])
    assert [q.pop() for _ in range(4)] == [preempted, cont[0], *new] and q.peek() is None


def test_one_requests_continuations_ahead_of_the_others_are_bounded_by_the_slots(tok: Tokenizer) -> None:
    """A request (a batch) puts at most `ahead` continued sequences ahead of the others at a time; the
    rest take turns with the other requests, and one taken makes room ahead again."""
    from engines.core.scheduler import FairQueue
    q = FairQueue(ahead=2)
    flood = [Sequence([1, 2, 3], SamplingParams(max_tokens=2), tok, set(), 64, lambda o: None, group=7, replayed=1)
             for _ in range(5)]
    other = Sequence([4, 5], SamplingParams(max_tokens=2), tok, set(), 64, lambda o: None)
    for s in flood[:4]:
        q.push(s)
    q.push(other)
    assert [q.queue_of(s) for s in flood[:4]] == ["continued", "continued", "new", "new"]
    assert [q.pop() for _ in range(3)] == [flood[0], flood[1], flood[2]]
    q.push(flood[4])  # (room ahead again: the first two were taken)
    assert [q.pop() for _ in range(3)] == [flood[4], other, flood[3]] and q.peek() is None


def test_sequences_put_later_start_in_one_step_and_an_abort_among_them_holds(tiny_model) -> None:
    """`put_later` (a failover's batch, engines/core/core_link.py `together`): every add is taken
    before the next step, in order, so an abort after its add stops it."""
    engine = make_engine(tiny_model)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seqs = [engine.sequence([5 + i, 6, 7], SamplingParams(**params.wire()), lambda o: None) for i in range(5)]
    engine.put_later(lambda: [("add", s) for s in seqs] + [("abort", seqs[2].seq_id)])
    engine._take_inbox(block=False)
    engine.step()
    assert [s.num_computed > 0 for s in seqs] == [True, True, False, True, True]
    assert seqs[2].finish_reason == "abort"


def test_requests_arriving_during_a_step_are_built_in_it_and_taken_first_in_order(tiny_model) -> None:
    """The scheduler thread makes the Sequences of what arrived while the step it launched runs
    (engines/core/engine.py `_arrivals`, called in `step`), and takes them before the step after it, in
    arrival order with the items queued after them; a build that raises is logged and left out,
    the loop goes on."""
    engine = make_engine(tiny_model)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    running = engine.sequence([3, 4, 5], SamplingParams(**params.wire()), lambda o: None)
    engine.put_later(lambda: [("add", running)])
    engine._take_inbox(block=False)
    built: list[int] = []

    def build(seq) -> list[tuple[str, object]]:
        built.append(engine.steps)
        return [("add", seq)]

    late = [engine.sequence([9, 8 + i], SamplingParams(**params.wire()), lambda o: None) for i in range(2)]
    engine.put_later(lambda: 1 / 0)  # (a bug in one build)
    engine.put_later(lambda: build(late[0]))
    engine.abort(late[0].seq_id)
    engine.put_later(lambda: build(late[1]))
    engine.step()  # builds them while its own work runs; admits none of them
    assert built == [0, 0] and engine.steps == 1 and not engine.scheduler.waiting
    assert [kind for kind, _ in engine._arrived] == ["add", "abort", "add"]
    engine._take_inbox(block=True)  # (never waits: the step took items)
    engine.step()
    assert late[0].finish_reason == "abort" and late[0].num_computed == 0 and late[1].num_computed == 2
    assert engine._arrived == [] and engine.inbox.empty()


def test_an_add_the_core_cannot_build_is_answered_with_an_error_and_its_group_goes_on(tiny_model, tmp_path) -> None:
    """engines/core/core_link.py: a malformed add in a `together` group (no prompt), over the real
    sockets, is answered with an error output under its key, naming why, never left waiting; the
    group's other adds and aborts become inbox items, in order. An abort sent after an add, in its
    own message, stops it though its Sequence was made after the abort arrived."""
    import zmq

    from engines.core.core_link import CoreLink, decode, encode

    engine = make_engine(tiny_model)
    to_core, to_frontend = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    link = CoreLink(engine, to_core, to_frontend)
    link.start()
    ctx = zmq.Context.instance()
    peer, outs = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    peer.connect(to_core)
    outs.connect(to_frontend)
    try:
        params = SamplingParams(max_tokens=4, temperature=0).wire()
        peer.send(encode({"op": "together", "msgs": [
            {"op": "add", "key": 1, "params": params, "group": 1},
            {"op": "add", "key": 2, "prompt": [5, 6], "params": params, "group": 2},
            {"op": "add", "key": 3, "prompt": [7, 8], "params": params, "group": 3},
            {"op": "abort", "key": 3}]}))
        peer.send(encode({"op": "add", "key": 4, "prompt": [9, 9], "params": params, "group": 4}))
        peer.send(encode({"op": "abort", "key": 4}))
        deadline = time.monotonic() + 10
        while engine.inbox.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine._take_inbox(block=False)
        assert outs.poll(10_000), "no answer to the add the core could not build"
        answer = decode(outs.recv())
    finally:
        peer.close(linger=0)
        outs.close(linger=0)
        link.close()
    assert answer["op"] == "out" and len(answer["outs"]) == 1
    key, _seq_id, _delta, finish, *_rest = answer["outs"][0]
    assert key == 1 and finish == "error" and "could not take this request" in answer["outs"][0][7]
    assert "prompt" in answer["outs"][0][7] and 1 not in link._keys
    waiting = list(engine.scheduler.waiting)
    assert [s.prompt_ids for s in waiting] == [[5, 6]] and link._keys == {2: waiting[0].seq_id}


def test_continuations_reach_the_core_as_raw_ids_with_their_keys_and_a_bad_raw_is_left_out(tiny_model, tmp_path) -> None:
    """engines/core/core_link.py: a continuation's ids and prompt block keys travel in the message's second
    frame, over the real sockets (EngineClient -> CoreLink); a fresh prompt beside them stays JSON. A
    member whose `raw` does not fit its frame, sent by another peer, is logged and left out; the
    rest of its group is kept (it is answered with an error: the previous test)."""
    import numpy as np
    import zmq

    from wire.block_keys import prompt_keys
    from engines.core.core_link import CoreLink, encode
    from engines.frontend.engine_client import EngineClient

    engine = make_engine(tiny_model)
    to_core, to_frontend = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    link = CoreLink(engine, to_core, to_frontend)
    link.start()
    client = EngineClient(to_core, to_frontend, (engine.blocks.root, 16))
    params = SamplingParams(max_tokens=4, temperature=0).wire()
    prompts = [np.arange(40, dtype=np.int64) * 7 + i for i in range(3)]
    with client.together():
        for p in prompts:
            client.submit(p, SamplingParams(**params), lambda o: None, 1, replayed=5)
        client.submit([7, 8, 9], SamplingParams(**params), lambda o: None, 2)
    kind, build = engine.inbox.get(timeout=10)
    items = build()
    assert kind == "later" and [k for k, _ in items] == ["add"] * 4
    for (_, seq), p in zip(items, prompts):
        assert seq.prompt_ids.tolist() == p.tolist() and seq.replayed == 5
        assert seq.prefix_keys == prompt_keys(p, engine.blocks.root, 16) and len(seq.prefix_keys) == 16 * 2
        assert seq.token_ids(30, 40) == p[30:].tolist()  # (a list, as the runner takes it)
    assert items[3][1].prompt_ids == [7, 8, 9] and items[3][1].replayed == 0

    peer = zmq.Context.instance().socket(zmq.PUSH)
    peer.connect(to_core)
    good = {"op": "add", "key": 90, "params": params, "group": 3, "replayed": 2, "raw": [0, 4, 0]}
    bad = dict(good, key=91, raw=[0, 5, 0])  # 40 bytes of ids in a 32-byte frame
    peer.send_multipart([encode({"op": "together", "msgs": [bad, good]}), np.arange(4, dtype="<i8").tobytes()])
    kind, build = engine.inbox.get(timeout=10)
    items = build()
    peer.close(linger=0)
    link.close()
    assert [k for k, _ in items] == ["add"] and items[0][1].prompt_ids.tolist() == [0, 1, 2, 3]
    assert items[0][1].prefix_keys is None


@pytest.mark.parametrize("where", [[0, 5, 0], [8, 4, 0], [0, 3, 1], [0, -1, 0], [0, 1], "0 1 0", [0, 1.0, 0],
                                   [True, 1, 0]])
def test_a_raw_that_does_not_fit_its_frame_is_refused_naming_it(where) -> None:
    from engines.core.core_link import raw_ids

    with pytest.raises(ValueError, match="raw"):
        raw_ids(memoryview(bytes(32)), where)


def test_first_use_warm_ups_leave_the_engine_as_it_was(tiny_model) -> None:
    """The startup warm-ups (engines/core/first_use.py, and the runner's index kernels) run here too (on
    CUDA they load kernels and fill the allocators' caches); the engine's tokens and blocks are untouched."""
    from engines.core import first_use
    engine = make_engine(tiny_model, max_num_seqs=8)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    before = engine.generate(prompts, params)
    first_use.warm_sampling(engine, engine.runner.max_seqs)
    engine.runner._warm_index_kernels()
    assert engine.generate(prompts, params) == before
    assert engine.blocks.used == 0


def test_block_copies_give_each_destination_its_sources_keys_and_values(tiny_model) -> None:
    """The runner's block copy (a continuation's tail, engines/core/tail_publisher.py): every destination gets
    its source's keys and values, every layer; the other blocks are untouched."""
    engine = make_engine(tiny_model, max_num_seqs=2)
    runner, kv = engine.runner, engine.runner.model.kv_cache
    for layer in kv:
        layer.copy_(torch.randn_like(layer))
    before = [layer.clone() for layer in kv]
    pairs = [(1, 11), (2, 12), (3, 13), (4, 14), (5, 15)]
    runner.copy_blocks(pairs)
    for layer, old in zip(kv, before):
        for src, dst in pairs:
            assert torch.equal(layer[:, dst], old[:, src])
        assert torch.equal(layer[:, 6:11], old[:, 6:11])
