"""The load: closed-loop workers streaming completions, each timing its chunks as they arrive.

A request counts as an error when it cannot connect, gets a non-200 answer, carries an error
event in its stream, or ends without `data: [DONE]` (a cut stream)."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

from .wire import Connection, WireError
from .workloads import RequestSpec


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from sending it."""

    ok: bool
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    usage_reported: bool = False  # False: output_tokens counts content chunks
    chunks: int = 0  # content chunks (fewer than tokens where the server held text back or merged)


def request_body(model: str, spec: RequestSpec, temperature: float, ignore_eos: bool) -> bytes:
    return json.dumps({"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
                       "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def _has_content(choice: dict) -> bool:
    """A chunk that brings tokens: text, or the finish (whose tokens' text may be empty); not
    the chat endpoint's opening role chunk."""
    if choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    return bool(isinstance(delta, dict) and delta.get("content"))


async def stream_one(conn: Connection, path: str, body: bytes) -> RequestResult:
    """Send one streaming request on `conn` and time it."""
    t0 = time.perf_counter()
    try:
        status, headers = await conn.post(path, body)
        if status != 200:
            text = b"".join([piece async for _, piece in conn.body(headers)]).decode("utf-8", "replace")
            return RequestResult(False, f"HTTP {status}: {text[:300]}", latency=time.perf_counter() - t0)
        return await _read_events(conn.body(headers), t0)
    except WireError as e:
        msg = str(e) if str(e).startswith("ConnectError") else f"stream cut: {e}"
        return RequestResult(False, msg, latency=time.perf_counter() - t0)


async def _read_events(pieces, t0: float) -> RequestResult:  # noqa: ANN001
    r = RequestResult(False)
    buf, last, done = b"", 0.0, False
    async for now, data in pieces:
        buf += data
        while (i := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:i], buf[i + 2:]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                try:
                    obj = json.loads(payload)
                except ValueError:
                    r.error = f"malformed event {payload[:120]!r}"
                    continue
                if not isinstance(obj, dict) or "error" in obj:
                    r.error = f"error event: {json.dumps(obj)[:300]}"
                    continue
                usage = obj.get("usage")
                if usage:
                    r.output_tokens = int(usage.get("completion_tokens", 0))
                    r.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    r.usage_reported = True
                if any(_has_content(c) for c in obj.get("choices") or ()):
                    if r.ttft is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
                    r.chunks += 1
    r.latency = time.perf_counter() - t0
    if not r.usage_reported:
        r.output_tokens = r.chunks
    if r.error is None and not done:
        r.error = "stream cut: ended without data: [DONE]"
    r.ok = r.error is None
    return r


async def run_point(url: str, path: str, bodies: list[bytes], concurrency: int, timeout_s: float,
                    duration_s: float | None = None, progress_every_s: float = 5.0,
                    label: str = "") -> tuple[list[RequestResult], float]:
    """`concurrency` workers send `bodies` in order, each the next one when its previous is done
    (closed loop); stop early after `duration_s` (requests in flight finish). Returns the results
    of the requests sent and the wall time from the first send to the last answer."""
    results: list[RequestResult] = []
    next_index = 0
    t0 = time.perf_counter()
    deadline = None if duration_s is None else t0 + duration_s

    async def worker() -> None:
        nonlocal next_index
        conn = Connection(url, timeout_s)
        try:
            while next_index < len(bodies) and (deadline is None or time.perf_counter() < deadline):
                body = bodies[next_index]
                next_index += 1
                results.append(await stream_one(conn, path, body))
        finally:
            conn.close()

    async def progress() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            errors = sum(not r.ok for r in results)
            print(f"  {label}{len(results)}/{len(bodies)} done, {errors} errors, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    ticker = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        ticker.cancel()
    return results, time.perf_counter() - t0
