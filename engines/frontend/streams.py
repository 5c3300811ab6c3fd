"""A request's answer as it streams: its sequences' Outputs as they come from the core (Running), and
a streaming request's server-sent events made from them (StreamEvents), sent by its own task
(EventStream) or framed into a failover's batch (engines/frontend/continuation_batch.py).

Outputs are made into events synchronously, whatever has arrived at once, in the one task that
writes them: no queue, task or generator per request between the core link and the socket. That
chain cost the front end ~12 us an output on the dev VM (a step of 256 streams: 3 ms), and a failover's
batch shares that CPU with the admission of its later members (bench/RESULTS.md, 2026-12-04)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from wire import sse
from wire.interrupt import unless_client_leaves
from engines.core.sequence import Output
from wire.stream_timing import STALL_LOG_S
from engines.frontend.stream_chunks import ChunkWriter

if TYPE_CHECKING:
    from .engine_client import EngineClient
    from .first_output import FirstOutputLatency

log = logging.getLogger("engines.frontend.server")

# Fault injection for tests and chaos runs only: a pause after each stream chunk, so a test can kill
# an engine at the k-th chunk of a stream deterministically. Unset (0) in production.
CHUNK_DELAY_S = float(os.environ.get("UNDERSTUDY_TEST_CHUNK_DELAY_S") or 0)
# A handed-off stream's end: an SSE comment (clients and the router skip it), and no [DONE].
HANDOFF_END = b": handed off to the new primary (planned switchover); no [DONE]: continue elsewhere\n\n"


class RequestFailed(Exception):
    """A sequence of the request ended with an error (e.g. non-finite logits); the engine goes on."""

    UNAVAILABLE = frozenset({"parked", "handoff"})  # this engine cannot serve it now; another can

    def __init__(self, message: str, code: str = "sampling_error") -> None:
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> int:
        return 503 if self.code in self.UNAVAILABLE else 500

    def body(self) -> dict:
        type_ = "service_unavailable" if self.status == 503 else "internal_error"
        return {"error": {"message": str(self), "type": type_, "param": None, "code": self.code}}


class HandedOff(RequestFailed):
    """The engine gave its KV pool up mid-request (a planned switchover): the router continues the
    request on the new primary. A stream ends without [DONE], so the router sees it cut."""

    def __init__(self) -> None:
        super().__init__("this engine handed its requests off to the new primary (planned switchover)", "handoff")


class Running:
    """A request's sequences in the core: their Outputs collect in arrival order (`emit`, from the
    core link's reader) until the request's writer takes them. `on_ready` runs when outputs arrive
    with none waiting (by default it wakes `wait()`; a batch points it at its own writer)."""

    def __init__(self, engine: "EngineClient", n: int, submitted: float, first_output: "FirstOutputLatency") -> None:
        self.engine, self.submitted, self.first_output = engine, submitted, first_output
        self.keys: list[int] = []
        self.live = set(range(n))
        self._pending: list[tuple[int, Output]] = []
        self._ready = asyncio.Event()
        self.on_ready: Callable[[], None] = self._ready.set

    def emit(self, index: int, out: Output) -> None:
        if not self._pending:
            self.on_ready()
        self._pending.append((index, out))

    @property
    def waiting(self) -> bool:
        return bool(self._pending)

    async def wait(self) -> None:
        """Until outputs are waiting."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()

    def take(self, one: bool = False) -> list[tuple[int, Output]]:
        """The waiting outputs, merged per choice (`one`: only the oldest, as it came)."""
        if one:
            return [self._pending.pop(0)]
        items, self._pending = self._pending, []
        return _coalesce(items) if len(items) > 1 else items

    def accept(self, index: int, out: Output) -> None:
        """Account for one output taken: its latency observed, its choice done once finished; a
        failed or handed-off sequence raises RequestFailed or HandedOff."""
        self.first_output.observe(self.submitted, out)
        if out.finish_reason is not None:
            self.live.discard(index)
            if out.finish_reason == "error":
                raise RequestFailed(out.error or "sampling failed", out.error_code or "sampling_error")
            if out.finish_reason == "handoff":
                raise HandedOff()

    def abort(self) -> None:
        """Stop the sequences still running (idempotent)."""
        for i in self.live:
            self.engine.abort(self.keys[i])
        self.live.clear()


class StreamEvents:
    """A streaming request's events from its outputs, made without awaiting: `opening()` (a chat
    stream's role chunks), then `feed(items)` until `ended` (its last events: the usage chunk if
    asked for and [DONE], or what ends a stream cut: an error event, a handoff's comment)."""

    def __init__(self, running: Running, kind: str, rid: str, created: int, model: str, prompt_tokens: int,
                 include_usage: bool, ids: bool, first_prompts: list | None = None) -> None:
        """``kind``: "completions" or "chat" (engines/frontend/stream_chunks.py); ``first_prompts``: each
        choice's prompt ids, for its first chunk (a client's request with ids; None for a
        continuation, whose client had them already)."""
        self.running, self.chat, self.ids = running, kind == "chat", ids
        self.writer = ChunkWriter(kind, rid, created, model, include_usage, ids)
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage
        self._first_prompts = first_prompts
        self._unsent = set(range(len(running.keys))) if first_prompts is not None and not self.chat else set()
        self._completion = [0] * len(running.keys)
        self.ended = False
        self.rid, self._fed_at = rid, 0.0  # (the last outputs taken: wire/stream_timing.py)

    def opening(self) -> list[bytes]:
        if not self.chat:
            return []
        prompt = self._first_prompts[0] if self._first_prompts is not None else None
        return [self.writer.choice(i, "", None, [], prompt, role=True) for i in range(len(self._completion))]

    def feed(self, items: list[tuple[int, Output]]) -> list[bytes]:
        """The events of outputs taken from `running`, the stream's end among them once it has ended."""
        now = time.monotonic()
        if self._fed_at and now - self._fed_at >= STALL_LOG_S:
            after = dict(enumerate(self._completion)) | {i: out.completion_tokens for i, out in items}
            log.warning("stream %s stalled: %.0f ms between outputs from the core, after %d tokens; the outputs "
                        "that ended it brought %d", self.rid, (now - self._fed_at) * 1e3, sum(self._completion),
                        sum(after.values()) - sum(self._completion))
        events: list[bytes] = []
        try:
            for index, out in items:
                self.running.accept(index, out)
                self._completion[index] = out.completion_tokens
                if out.delta or out.finish_reason or out.token_ids:  # (a token with no text: a chunk all the same)
                    events.append(self._chunk(index, out))
                elif self.ids and out.is_scheduled:
                    events.append(sse.SCHEDULED)
        except HandedOff:
            return self._end(events, HANDOFF_END)
        except RequestFailed as e:
            (log.error if e.status == 500 else log.info)("stream failed: %s", e)
            return self._end(events, b"data: %s\n\n" % json.dumps(e.body()).encode())
        if not self.running.live:
            if self.include_usage:
                events.append(self.writer.usage(self.prompt_tokens, sum(self._completion)))
            return self._end(events, sse.DONE)
        if any(self._completion):  # (from the first token on: the wait for it is the time to a first token)
            self._fed_at = now
        return events

    def _chunk(self, index: int, out: Output) -> bytes:
        if self.chat:
            return self.writer.choice(index, out.delta or None, out.finish_reason, out.token_ids)
        prompt = None
        if index in self._unsent:
            self._unsent.discard(index)
            prompt = self._first_prompts[index]  # type: ignore[index]
        return self.writer.choice(index, out.delta, out.finish_reason, out.token_ids, prompt)

    def _end(self, events: list[bytes], end: bytes) -> list[bytes]:
        self.ended = True
        self.running.abort()
        events.append(end)
        return events


class EventStream:
    """A streaming answer (server-sent events) whose sequences were started before it, as a bare
    ASGI callable: its events go out from the request's own task (no task group, no task of its
    own: see wire/interrupt.py), it stops when the client leaves, the last event and the body's
    end go out in one write, and the sequences are aborted however it ends, also before its body
    began. A stream that fails ends with an error event and no [DONE]: cut, and saying so."""

    def __init__(self, events: StreamEvents) -> None:
        self.events, self.running = events, events.running

    async def __call__(self, scope: dict, receive, send) -> None:
        try:
            await unless_client_leaves(self._send_all(send), receive)
        finally:
            self.running.abort()

    async def _send_all(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": sse.HEADERS})
        stream = self.events
        if CHUNK_DELAY_S:
            async for event, last in paced(stream):
                await send({"type": "http.response.body", "body": event, "more_body": not last})
            return
        pending = stream.opening()
        while True:
            if pending:
                began = time.monotonic()
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": not stream.ended})
                if (took := time.monotonic() - began) >= STALL_LOG_S:
                    log.warning("stream %s stalled: its reader took %.0f ms to take a chunk", stream.rid, took * 1e3)
            if stream.ended:
                return
            await self.running.wait()
            pending = stream.feed(self.running.take())


async def paced(stream: StreamEvents) -> AsyncIterator[tuple[bytes, bool]]:
    """A stream's events one output at a time, with the test pause (CHUNK_DELAY_S) after each chunk
    but the last, and whether each is the last."""
    pending = stream.opening()
    while True:
        for i, event in enumerate(pending):
            last = stream.ended and i == len(pending) - 1
            yield event, last
            if not last and event is not sse.SCHEDULED:
                await asyncio.sleep(CHUNK_DELAY_S)
        if stream.ended:
            return
        await stream.running.wait()
        pending = stream.feed(stream.running.take(one=True))


def _coalesce(items: list[tuple[int, Output]]) -> list[tuple[int, Output]]:
    """Outputs that queued up while the writer was busy, merged per choice: a slow reader gets
    fewer, larger chunks instead of falling further behind. A scheduled marker is kept, first
    (merged into the tokens after it, it was lost: the router then took a request that ran for one
    only queued)."""
    markers = [(index, out) for index, out in items if out.is_scheduled]
    merged: dict[int, Output] = {}
    for index, out in items:
        if out.is_scheduled:
            continue
        prev = merged.get(index)
        merged[index] = out if prev is None else dataclasses.replace(
            out, delta=prev.delta + out.delta, token_ids=prev.token_ids + out.token_ids,
            timing=prev.timing or out.timing)
    return markers + list(merged.items())
