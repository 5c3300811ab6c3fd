"""What the front end spends on each output of plain streaming requests (no batch): N streams through
the engine's ASGI app (engines/server.py build_app) in this process, their adds going to a core socket
(a process of its own) that drops them; then steps of outputs, one token for every stream in one
message as the core sends a step's, each timed from its arrival to the last of its chunks handed to
the server (the sockets' writes are not in it).

    python3 bench/probes/stream_relay.py MODEL_DIR [--n 256] [--steps 30]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import zmq

from engines.block_keys import key_root
from engines.engine_client import EngineClient
from engines.server import OpenAIServer, build_app
from engines.tokenizer import Tokenizer


def drop(endpoint: str, out) -> None:
    """(Its own process, as the core is.) Takes every message and does nothing with it."""
    core = zmq.Context().socket(zmq.PULL)
    core.bind(endpoint)
    out.send("bound")
    while True:
        core.recv()


async def main_async(a) -> None:
    model = Path(a.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="relay-"))
    ours, theirs = multiprocessing.Pipe()
    multiprocessing.get_context("fork").Process(target=drop, args=(f"ipc://{tmp}/in", theirs), daemon=True).start()
    assert ours.recv() == "bound"
    to_frontend = zmq.Context.instance().socket(zmq.PUSH)
    to_frontend.bind(f"ipc://{tmp}/out")
    client = EngineClient(f"ipc://{tmp}/in", f"ipc://{tmp}/out", (key_root(False), 16))
    app = build_app(OpenAIServer(client, Tokenizer(model), [model.name], 4096, vocab, lambda: {}))
    chunks, more = [0], asyncio.Event()

    async def send(message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks[0] += 1
            more.set()

    def request(body: bytes):
        sent = [False]

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays
        return app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""},
                   receive, send)

    body = json.dumps({"model": model.name, "prompt": list(range(5, 105)), "max_tokens": 1000, "stream": True,
                       "return_token_ids": True}).encode()
    tasks = [asyncio.ensure_future(request(body)) for _ in range(a.n)]
    while len(client._emits) < a.n:
        await asyncio.sleep(0.01)
    keys, times = list(client._emits), []
    for step in range(a.steps):
        outs = [[k, k, " x", None, 100, step + 1, [17], None, None if step else (0.0, 0.0), None] for k in keys]
        want, t0 = chunks[0] + a.n, time.monotonic()
        client._handle({"op": "out", "outs": outs})
        while chunks[0] < want:
            more.clear()
            await more.wait()
        times.append(time.monotonic() - t0)
    for t in tasks:
        t.cancel()
    med = statistics.median(times)
    print(f"{a.n} plain streams: a step's outputs to the last of their chunks, median {med * 1e3:.2f} ms of "
          f"{a.steps} steps (max {max(times) * 1e3:.2f}); {med * 1e6 / a.n:.1f} us an output")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    asyncio.run(main_async(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
