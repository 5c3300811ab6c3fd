"""A stream that stalls mid-way is never silent (wire/stream_timing.py), with real processes: a node on
the tiny model (CPU), a stream read until its tokens flow, then the primary's core stopped (SIGSTOP)
for longer than STALL_LOG_S and let go on (SIGCONT). The engine's front end logs that the stream
waited between outputs from the core, the router that it waited for the engine's bytes, each as the
wait ended; the stream ends
whole, and a stream that did not stall logs nothing."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from wire.stream_timing import STALL_LOG_S
from harness.node import running

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}, name: m}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 4, max_model_len: 512}}
failover: {{heartbeat_timeout_s: 5, probe_interval_s: 0.5, probe_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""
STOP_S = STALL_LOG_S + 0.4
BODY = {"model": "m", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("stall")
    with running(work, CONFIG.format(rt=work / "rt", model=tiny_model)) as h:
        yield h


def stream(node, stop_core_after: int | None = None) -> tuple[int, bool]:
    """Stream BODY through the router; after `stop_core_after` chunks, stop the primary's core for
    STOP_S. Returns the chunks and whether [DONE] came."""
    core = node.primary()["pid"]
    chunks, done = 0, False
    with httpx.stream("POST", node.router_url + "/v1/completions", json=BODY, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                json.loads(line[6:])
                chunks += 1
                if chunks == stop_core_after:
                    os.kill(core, signal.SIGSTOP)
                    try:
                        time.sleep(STOP_S)
                    finally:
                        os.kill(core, signal.SIGCONT)
    return chunks, done


def stall_lines(path, pattern: str, group: int = 1) -> list[float]:
    """The ms (the `(\\d+)` of `pattern`; `group`: another one) of every stall line in the log at `path`."""
    return [float(m[group]) for m in re.finditer(pattern, path.read_text())]


CORE = r"stalled: (\d+) ms between outputs from the core"
ROUTER = r"stalled on \w+: no bytes from the engine for (\d+) ms"


def engine_log(node):
    p = node.primary()
    return node.rd / "logs" / f"{p['name']}-{p['incarnation']}.log"


def test_a_stream_whose_core_stopped_is_logged_by_the_front_end_and_the_router(node) -> None:
    chunks, done = stream(node, stop_core_after=5)
    assert done and chunks > 5
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (stall_lines(engine_log(node), CORE)
                                               and stall_lines(node.log, ROUTER)):
        time.sleep(0.1)
    core = stall_lines(engine_log(node), CORE)
    router = stall_lines(node.log, ROUTER)
    assert core and max(core) >= STALL_LOG_S * 1e3, engine_log(node).read_text()[-2000:]
    assert router and max(router) >= STALL_LOG_S * 1e3, node.tail()
    # a stopped core generated nothing meanwhile: the outputs that ended the wait brought a few tokens
    # (a step or two; a looping model's text-less tokens, before every token was a chunk, brought 99-188)
    brought = stall_lines(engine_log(node), CORE + r".*brought (\d+)", group=2)
    assert brought and all(n < 10 for n in brought), engine_log(node).read_text()[-2000:]
    assert node.primary()["role"] == "primary"  # (the stop was shorter than the hang timeout: no failover)


def test_a_stream_that_flowed_logs_no_stall(node) -> None:
    before = len(stall_lines(node.log, ROUTER)), len(stall_lines(engine_log(node), CORE))
    chunks, done = stream(node)
    assert done and chunks > 5
    time.sleep(0.3)
    after = len(stall_lines(node.log, ROUTER)), len(stall_lines(engine_log(node), CORE))
    assert after == before
