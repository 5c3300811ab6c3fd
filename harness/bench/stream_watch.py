"""One client process of `understudy bench failover --streams N`: keeps its share of streams in flight
through the router (closed loop, nano-like lengths as token ids), records the arrival time of every
content chunk (perf_counter: the system-wide monotonic clock, comparable across processes), and, once
told the kill times, answers per kill the gap each stream in flight saw across it.

Protocol on stdin/stdout (JSON lines): job -> "ready"; "go" -> run; "stop" -> finish the streams in
flight -> "stopped"; {"kills": [t, ...]} -> the report; then exit."""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

from harness.bench.serve.wire import Connection, WireError
from harness.bench.serve.workloads import Lengths, random_ids


@dataclass
class Stream:
    """One request: when it was sent, its content chunks' arrival times, how it ended."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    error: str | None = None
    end: float = 0.0


def gap_across(s: Stream, t: float) -> float | None:
    """The gap between the last chunk before `t` (or the send) and the first after it, for a stream
    in flight at `t`; None if it was not (or never got a chunk after `t`)."""
    if not s.sent < t < s.end:
        return None
    before = s.sent
    for c in s.chunks:
        if c > t:
            return c - before
        before = c
    return None


def longest_gap(s: Stream) -> float:
    """The longest wait between two content chunks (from the send for the first)."""
    times = [s.sent, *s.chunks]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


async def one(conn: Connection, body: bytes) -> Stream:
    s = Stream(time.perf_counter())
    try:
        status, headers = await conn.post("/v1/completions", body)
        if status != 200:
            s.error = f"HTTP {status}"
            async for _ in conn.body(headers):
                pass
        else:
            done = False
            async for now, data in conn.body(headers):
                if b'"text"' in data:  # a content chunk (one read can hold several: they arrive together)
                    s.chunks.append(now)
                if b"[DONE]" in data:
                    done = True
                if b'"error"' in data:
                    s.error = "error event"
            if not done and s.error is None:
                s.error = "stream cut: no [DONE]"
    except WireError as e:
        s.error = str(e)[:200]
    s.end = time.perf_counter()
    return s


async def run(job: dict, stop: asyncio.Event) -> list[Stream]:
    rng = random.Random(job["seed"])
    inp, out = Lengths.parse(job["input"], "input"), Lengths.parse(job["output"], "output")
    done: list[Stream] = []

    def body() -> bytes:
        return json.dumps({"model": job["model"], "prompt": random_ids(rng, inp.draw(rng), job["vocab"]),
                           "max_tokens": out.draw(rng), "temperature": 0, "ignore_eos": True,
                           "stream": True}).encode()

    async def worker() -> None:
        conn = Connection(job["url"], job["timeout_s"])
        try:
            while not stop.is_set():
                done.append(await one(conn, body()))
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(job["streams"])))
    return done


def report(streams: list[Stream], kills: list[float], window_s: float) -> dict:
    """Per kill, the gap every stream in flight saw across it; the other streams' longest gaps; the
    failures, and when each happened."""
    across = [[g for s in streams if (g := gap_across(s, t)) is not None] for t in kills]
    calm = [longest_gap(s) for s in streams if s.error is None and
            not any(s.sent - window_s < t < s.end + window_s for t in kills)]
    failed = [{"sent": s.sent, "end": s.end, "error": s.error} for s in streams if s.error]
    return {"across": across, "calm": calm, "failed": failed, "requests": len(streams),
            "chunks": sum(len(s.chunks) for s in streams)}


def main() -> int:
    job = json.loads(sys.stdin.readline())
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    cpu0, wall0 = time.process_time(), time.perf_counter()

    async def go() -> list[Stream]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(sys.stdin.fileno(), lambda: (sys.stdin.readline(), stop.set()))
        return await run(job, stop)

    streams = asyncio.run(go())
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print("stopped", flush=True)
    kills = json.loads(sys.stdin.readline())["kills"]
    print(json.dumps({**report(streams, kills, job["window_s"]), "cpu_s": cpu, "wall_s": wall}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
