"""What a failover's batch of continuations costs the engine's front end alone, in its own process:
the body of N continuations (prompt + generated ids, built as the router builds them) goes through the
front end's ASGI app (engines/server.py build_app), whose members reach a core socket (in a process
of its own) that only counts them. Prints the wall time from the body's arrival to the last member
at the core, per member, and with --profile the front end's functions that took it.

    python3 bench/probes/frontend_batch.py MODEL_DIR [--n 256] [--prompt 600] [--done 300] [--rounds 5] [--profile]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import multiprocessing
import pstats
import random
import statistics
from array import array
import tempfile
import time
from pathlib import Path

import orjson
import zmq

from continuation_burst import burst_arguments
from engines import gc_pauses
from engines.block_manager import key_root
from engines.engine_client import EngineClient
from engines.server import OpenAIServer, build_app
from engines.tokenizer import Tokenizer
from supervisor.router.continuation import Tracked


def batch_body(model: str, vocab: int, n: int, prompt: int, done: int) -> bytes:
    """A batch as the router builds it (supervisor/router/continuation.py `upstream_body`): each member
    a completion whose engine had sent `done` tokens of it."""
    rng = random.Random(0)
    members = []
    for seed in range(n):
        ids = [rng.randrange(vocab) for _ in range(prompt + done)]
        req = Tracked("completions", {"model": model, "prompt": ids[:prompt], "max_tokens": done + 16, "stream": True,
                                      "ignore_eos": True, "seed": seed})
        req.prompt_ids, req.output_ids = array("q", ids[:prompt]), array("q", ids[prompt:])
        members.append(req.batch_member(b"/v1/completions"))
    return b"".join(members)


def core_counter(endpoint: str, n: int, rounds: int, out) -> None:
    """(Its own process, as the core is.) Per round, the moment the core socket holds all n members' adds."""
    core = zmq.Context().socket(zmq.PULL)
    core.bind(endpoint)
    out.send("bound")
    for _ in range(rounds):
        got = 0
        while got < n:
            msg = orjson.loads(core.recv())
            got += len(msg["msgs"]) if msg["op"] == "together" else msg["op"] == "add"
        out.send(time.monotonic())


async def one_batch(app, body: bytes, counted) -> float:
    """Seconds from the body's arrival to the core holding all its members' adds (the answer's frames
    are dropped: no core answers them)."""
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        pass

    t0 = time.monotonic()
    task = asyncio.ensure_future(app({"type": "http", "method": "POST", "path": "/v1/continuations",
                                      "headers": [], "query_string": b""}, receive, send))
    while not counted.poll():
        await asyncio.sleep(0.005)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return counted.recv() - t0


async def main_async(a) -> None:
    model = Path(a.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="fe-"))
    ours, theirs = multiprocessing.Pipe()
    counter = multiprocessing.get_context("fork").Process(target=core_counter,
                                                          args=(f"ipc://{tmp}/in", a.n, a.rounds, theirs))
    counter.start()
    assert ours.recv() == "bound"
    out = zmq.Context.instance().socket(zmq.PUSH)
    out.bind(f"ipc://{tmp}/out")
    client = EngineClient(f"ipc://{tmp}/in", f"ipc://{tmp}/out", (key_root(False), 16))
    srv = OpenAIServer(client, Tokenizer(model), [model.name], a.prompt + a.done + 64, vocab, lambda: {})
    app = build_app(srv)
    body = batch_body(model.name, vocab, a.n, a.prompt, a.done)
    gc_pauses.freeze_startup()  # as the front end does before it serves (engines/frontend.py)
    if a.no_gc:
        gc.disable()
    pauses = gc_pauses.watch()
    prof = cProfile.Profile() if a.profile else None
    times = []
    for i in range(a.rounds):
        if prof and i == a.rounds - 1:
            prof.enable()
        times.append(await one_batch(app, body, ours))
        if prof and i == a.rounds - 1:
            prof.disable()
    counter.join()
    ms = [t * 1e3 for t in times]
    print(f"{a.n} continuations of {a.prompt}+{a.done} ids, {len(body) / 1e6:.2f} MB: body to the last member "
          f"at the core, median {statistics.median(ms):.1f} ms of {a.rounds} (min {min(ms):.1f}, max {max(ms):.1f}); "
          f"{statistics.median(ms) * 1e3 / a.n:.0f} us a member; collections by generation over the rounds: "
          + ", ".join(f"{n} ({t * 1e3:.1f} ms)" for n, t in zip(pauses.count, pauses.total_s)))
    if prof:
        pstats.Stats(prof).sort_stats(a.sort).print_stats(30)


def main() -> int:
    p = burst_arguments(argparse.ArgumentParser())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sort", default="tottime", help="the profile's order (pstats: tottime, cumulative)")
    p.add_argument("--no-gc", action="store_true", help="the garbage collector off (else as the front end runs it)")
    asyncio.run(main_async(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
