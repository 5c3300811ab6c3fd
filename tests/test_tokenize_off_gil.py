"""Tokenizing a huge prompt leaves other Python threads (the engine's scheduler and its heartbeats)
running: the engine's prompt path hands long texts to the tokenizer in a worker thread through
``encode_batch``, whose Rust side releases the GIL. Measured against plain ``encode``, which does not."""
from __future__ import annotations

import asyncio
import threading
import time

from engines.limits import RequestLimits
from engines.prompts import completion_prompt_ids
from engines.tokenizer import Tokenizer

TEXT = "hello world " * 200_000  # 2.4 MB (issue 12: 8x this stalled heartbeats 4.5 s)


def max_gap_while(work) -> tuple[float, object]:
    """The longest pause a 5 ms ticking thread sees while ``work()`` runs; and its result."""
    gaps, stop = [0.0], threading.Event()

    def tick():
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    t = threading.Thread(target=tick)
    t.start()
    try:
        result = work()
    finally:
        stop.set()
        t.join()
    return max(gaps), result


def test_engine_prompt_path_does_not_hold_the_gil(tiny_model):
    tok = Tokenizer(tiny_model)
    limits = RequestLimits(max_prompt_tokens=10**7)
    gil_held, direct = max_gap_while(lambda: tok.encode(TEXT))
    gap, ids = max_gap_while(lambda: asyncio.run(completion_prompt_ids(tok, TEXT, 1, limits, 10**7)))
    assert ids == [direct]  # the same tokens as the plain path
    print(f"longest pause of another thread: encode {gil_held:.3f}s, engine prompt path {gap:.3f}s")
    assert gap < 0.5 and gap < gil_held / 2, (gap, gil_held)
