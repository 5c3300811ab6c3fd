"""An engine's front end leaves no reference cycle behind a request: plain streams and a failover's
batch of continuations (engines/frontend/streams.py, engines/frontend/continuation_batch.py), ended every way (finished,
a member aborted, the client gone), are freed by reference counting, not left for the garbage
collector, whose pauses stall every stream. The front end's ASGI app in this process, its core link
on real zmq sockets to a core that only takes the adds; the core's step outputs are handed to the
link's reader as they would come."""
from __future__ import annotations

import asyncio
import json
import threading
from array import array
from collections.abc import Iterator

import pytest
import zmq

from wire.batch_wire import encode_member
from wire.block_keys import key_root
from engines.frontend.engine_client import EngineClient
from engines.frontend.server import OpenAIServer, build_app
from engines.core.tokenizer import Tokenizer
from tests.supervisor.router.test_router_no_cycles import cycles_left_by


@pytest.fixture()
def frontend(tiny_model, tmp_path) -> Iterator[tuple[EngineClient, object, str]]:
    ctx = zmq.Context.instance()
    core = ctx.socket(zmq.PULL)
    core.bind(f"ipc://{tmp_path}/in")
    stop = threading.Event()

    def take() -> None:  # (the core: takes the adds, answers nothing)
        while not stop.is_set():
            if core.poll(50):
                core.recv()
    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    out = ctx.socket(zmq.PUSH)
    out.bind(f"ipc://{tmp_path}/out")
    client = EngineClient(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", (key_root(False), 16))
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    app = build_app(OpenAIServer(client, Tokenizer(tiny_model), [tiny_model.name], 512, vocab, lambda: {}))
    yield client, app, tiny_model.name
    stop.set()
    taker.join()
    core.close(0)
    out.close(0)


def exchange(app, path: str, body: bytes, leave: asyncio.Event, heads: list | None = None) -> asyncio.Task:
    """One request through the app; its client leaves when `leave` is set (its response's head's
    headers go to `heads`)."""
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message) -> None:
        if heads is not None and message["type"] == "http.response.start":
            heads.append(dict(message["headers"]))
    return asyncio.ensure_future(app({"type": "http", "method": "POST", "path": path, "headers": [],
                                      "query_string": b""}, receive, send))


async def steps(client: EngineClient, keys: list[int], n: int, finish: bool) -> None:
    """`n` steps of one token for each of `keys` (the last with finish_reason "length" if `finish`)."""
    for step in range(n):
        last = finish and step == n - 1
        client._handle({"op": "out", "outs": [[k, k, " x", "length" if last else None, 4, step + 1, [7], None,
                                                None if step else (0.0, 0.0), None] for k in keys]})
        for _ in range(3):
            await asyncio.sleep(0)


def test_plain_streams_and_a_batch_leave_no_cycles(frontend) -> None:
    client, app, model = frontend

    async def work() -> None:
        stream = json.dumps({"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "stream": True,
                             "return_token_ids": True}).encode()
        chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        member = json.dumps({"model": model, "max_tokens": 8, "stream": True, "return_token_ids": True}).encode()
        batch = b"".join(encode_member(b"/v1/completions", member, array("q", [5, 6, 7, 8 + i]), array("q", [9]))
                         for i in range(20))  # (more than one group of members)
        stays, leaves, heads = asyncio.Event(), asyncio.Event(), []
        tasks = [exchange(app, "/v1/completions", stream, stays), exchange(app, "/v1/chat/completions", chat, stays),
                 exchange(app, "/v1/completions", stream, leaves), exchange(app, "/v1/continuations", batch, stays, heads),
                 exchange(app, "/v1/continuations", batch, leaves)]
        while len(client._emits) < 3 + 2 * 20:
            await asyncio.sleep(0.01)
        keys = list(client._emits)
        await steps(client, keys, 2, finish=False)
        abort = json.dumps({"batch": heads[0][b"x-understudy-batch"].decode(), "index": 3}).encode()
        await exchange(app, "/v1/continuations/abort", abort, stays)  # one member's client left
        leaves.set()  # a plain stream's client and a whole batch's leave mid-stream
        await steps(client, [k for k in keys if k in client._emits], 2, finish=True)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert not client._emits  # (every sequence ended or was aborted)

    found = cycles_left_by(lambda: asyncio.run(work()))
    assert not found, f"our objects left in reference cycles: {found.most_common(8)}"
