"""Tokenizing a huge prompt leaves other Python threads (the engine's scheduler and its heartbeats)
running: the engine's prompt path hands long texts to the tokenizer in a worker thread through
``encode_batch``, whose Rust side releases the GIL. Measured against plain ``encode``, which does not."""
from __future__ import annotations

import asyncio
import threading
import time

from wire.limits import RequestLimits
from engines.frontend.prompts import completion_prompt_ids
from engines.core.tokenizer import Tokenizer

TEXT = "hello world " * 200_000  # 2.4 MB (issue 12: 8x this stalled heartbeats 4.5 s)


def ticks_while(work) -> tuple[int, object]:
    """How many times a thread ticking every 5 ms ran while ``work()`` ran (it needs the GIL each
    time); and ``work()``'s result."""
    ticks, running, stop = [0], threading.Event(), threading.Event()

    def tick():
        while not stop.is_set():
            time.sleep(0.005)
            if running.is_set():
                ticks[0] += 1
    t = threading.Thread(target=tick)
    t.start()
    try:
        time.sleep(0.02)  # ticking
        running.set()
        result = work()
        running.clear()
    finally:
        stop.set()
        t.join()
    return ticks[0], result


def test_engine_prompt_path_does_not_hold_the_gil(tiny_model):
    """Counted, not timed: while plain ``encode`` runs, the other thread hardly runs at all (it holds
    the GIL); while the engine's prompt path tokenizes the same text, it keeps running."""
    tok = Tokenizer(tiny_model)
    limits = RequestLimits(max_prompt_tokens=10**7)
    held, direct = ticks_while(lambda: tok.encode(TEXT))
    ran, ids = ticks_while(lambda: asyncio.run(completion_prompt_ids(tok, TEXT, 1, limits, 10**7)))
    assert ids == [direct]  # the same tokens as the plain path
    print(f"another thread's 5 ms ticks meanwhile: encode {held}, engine prompt path {ran}")
    assert ran >= 10 * max(held, 1), (held, ran)


def test_a_request_over_the_context_is_refused_after_its_first_chunk(tiny_model):
    """An 8 MB request of prompts each over the context: tokenized chunk by chunk (about 1 MB each)
    off the GIL, the first chunk's context check ends it: counted on the tokenizer's own calls."""
    from engines.frontend.prompts import CHUNK_CHARS
    from wire.limits import LimitError
    calls = []

    class Counting(Tokenizer):
        def encode_batch(self, texts):  # noqa: ANN001, ANN201
            calls.append(len(texts))
            return super().encode_batch(texts)
    tok = Counting(tiny_model)
    text = "hello world " * 1440  # ~2900 tokens: over a 1024-token context
    prompts = [text] * 480
    assert sum(map(len, prompts)) > 7 * CHUNK_CHARS
    try:
        asyncio.run(completion_prompt_ids(tok, prompts, 1, RequestLimits(max_prompts=480, max_sequences=480), 1024))
    except LimitError as e:
        assert e.key == "context_length_exceeded", e
    else:
        raise AssertionError("not refused")
    assert len(calls) == 1 and calls[0] < len(prompts), calls  # one chunk of the 480 prompts, not all
