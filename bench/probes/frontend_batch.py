"""What a failover's batch of continuations costs the engine's front end alone, in its own process:
the body of N continuations (prompt + generated ids, built as the router builds them) goes through the
front end's ASGI app (engines/server.py build_app), whose members reach a core socket (in a process
of its own) that only counts them. Prints the wall time from the body's arrival to the last member
at the core, per member, and with --profile the front end's functions that took it (--sort: their
order). With --steps K, each round then hands the front end K steps of outputs (a token for every
member, in one message as the core sends a step's) and times each to the last of its frames.

    python3 bench/probes/frontend_batch.py MODEL_DIR [--n 256] [--prompt 600] [--done 300] [--rounds 5]
        [--steps K] [--profile [--sort cumulative]] [--no-gc] [--no-router-keys]
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
from engines.block_keys import KeyChain, key_root
from engines.engine_client import EngineClient
from engines.server import OpenAIServer, build_app
from engines.tokenizer import Tokenizer
from supervisor.router.continuation import Tracked


def batch_body(model: str, vocab: int, n: int, prompt: int, done: int, keys: bool = True) -> bytes:
    """A batch as the router builds it (supervisor/router/continuation.py `upstream_body`): each member
    a completion whose engine had sent `done` tokens of it; with `keys`, its block keys as the router
    hashed them while the stream went (engines/block_keys.py KeyChain), else none (the front end hashes)."""
    rng = random.Random(0)
    members = []
    for seed in range(n):
        ids = [rng.randrange(vocab) for _ in range(prompt + done)]
        req = Tracked("completions", {"model": model, "prompt": ids[:prompt], "max_tokens": done + 16, "stream": True,
                                      "ignore_eos": True, "seed": seed})
        req.prompt_ids, req.output_ids = array("q", ids[:prompt]), array("q", ids[prompt:])
        if keys:
            req.keys = KeyChain(16)
            req.keys.catch_up(req.prompt_ids, req.output_ids)
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
            msg = orjson.loads(core.recv_multipart()[0])  # (a continuation's ids: the second frame)
            got += len(msg["msgs"]) if msg["op"] == "together" else msg["op"] == "add"
        out.send(time.monotonic())


class Frames:
    """The batch's answer as it is sent: frames counted per step of `relay_steps`."""

    def __init__(self) -> None:
        self.count = 0
        self.more = asyncio.Event()

    async def send(self, message) -> None:
        body = message.get("body", b"")
        at = 0
        while (nl := body.find(b"\n", at)) >= 0:  # (a frame's head, then its payload)
            at = nl + 1 + int(body[at:nl].split(b" ")[2])
            self.count += 1
        self.more.set()


async def relay_steps(client: EngineClient, frames: Frames, steps: int) -> list[float]:
    """Seconds from each of `steps` steps' outputs (one token for every member, in one message, as the
    core sends a step's) to the last of their frames handed to the server: the front end's relay of
    the batch's streams, which shares its CPU with the admission of a failover's later members."""
    keys = list(client._emits)  # (the members' sequences, as the core knows them)
    times = []
    for step in range(steps):
        outs = [[k, k, " x", None, 600, 300 + step + 1, [17], None, None if step else (0.0, 0.0), None] for k in keys]
        want = frames.count + len(keys)
        t0 = time.monotonic()
        client._handle({"op": "out", "outs": outs})
        while frames.count < want:
            frames.more.clear()
            await frames.more.wait()
        times.append(time.monotonic() - t0)
    return times


async def one_batch(app, body: bytes, counted, client: EngineClient, steps: int) -> tuple[float, list[float]]:
    """Seconds from the body's arrival to the core holding all its members' adds, then (`steps`) the
    relay of each step's outputs (relay_steps)."""
    sent = [False]
    frames = Frames()

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays

    t0 = time.monotonic()
    task = asyncio.ensure_future(app({"type": "http", "method": "POST", "path": "/v1/continuations",
                                      "headers": [], "query_string": b""}, receive, frames.send))
    while not counted.poll():
        await asyncio.sleep(0.005)
    admitted = counted.recv() - t0
    relayed = await relay_steps(client, frames, steps) if steps else []
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return admitted, relayed


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
    body = batch_body(model.name, vocab, a.n, a.prompt, a.done, not a.no_router_keys)
    gc_pauses.freeze_startup()  # as the front end does before it serves (engines/frontend.py)
    if a.no_gc:
        gc.disable()
    pauses = gc_pauses.watch()
    prof = cProfile.Profile() if a.profile else None
    times, relayed = [], []
    for i in range(a.rounds):
        if prof and i == a.rounds - 1:
            prof.enable()
        admitted, steps = await one_batch(app, body, ours, client, a.steps)
        times.append(admitted)
        relayed += steps
        if prof and i == a.rounds - 1:
            prof.disable()
    counter.join()
    ms = [t * 1e3 for t in times]
    print(f"{a.n} continuations of {a.prompt}+{a.done} ids, {len(body) / 1e6:.2f} MB: body to the last member "
          f"at the core, median {statistics.median(ms):.1f} ms of {a.rounds} (min {min(ms):.1f}, max {max(ms):.1f}); "
          f"{statistics.median(ms) * 1e3 / a.n:.0f} us a member; collections by generation over the rounds: "
          + ", ".join(f"{n} ({t * 1e3:.1f} ms)" for n, t in zip(pauses.count, pauses.total_s)))
    if relayed:
        rs = [t * 1e3 for t in relayed]
        print(f"  then a step's outputs to the last of their frames: median {statistics.median(rs):.2f} ms of "
              f"{len(rs)} steps (max {max(rs):.2f}); {statistics.median(rs) * 1e3 / a.n:.1f} us an output")
    if prof:
        pstats.Stats(prof).sort_stats(a.sort).print_stats(30)


def main() -> int:
    p = burst_arguments(argparse.ArgumentParser())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=0, help="then relay this many steps' outputs (one token a member)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-router-keys", action="store_true", help="members without the router's block keys (before 2026-12-04)")
    p.add_argument("--sort", default="tottime", help="the profile's order (pstats: tottime, cumulative)")
    p.add_argument("--no-gc", action="store_true", help="the garbage collector off (else as the front end runs it)")
    asyncio.run(main_async(p.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
