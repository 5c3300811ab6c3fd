"""`POST /v1/continuations`: the streams a failover continues, in one request and one response.

At a failover the router continues at once every stream the dead primary served (256 in the H200
runs of bench/RESULTS.md). As one HTTP exchange each, they cost the router and this front end a few
tenths of a millisecond of CPU apiece, one after another, so the last stream of a burst waited
~100-200 ms longer than the first. Here every member is checked and started as its own
`/v1/completions` or `/v1/chat/completions` request would be (a bad one gets its own refusal, the
others go on). The request's members are framed with their token ids raw (wire/batch_wire.py);
the members' event streams go out framed in one body, whatever has queued up in one write:

    b"%d %d %d\\n" % (index, status, len(payload)) + payload

status 200: bytes of member `index`'s event stream, exactly as its own response would carry them;
status 0: that stream's end (no payload); any other status: the member was refused and the payload
is the error body its own request would have had. The head goes out at once and the members are
started in order, a group at a time, each group's sequences in one step of the core, the groups
back to back (the frames flow once the last is started: the core runs the first groups meanwhile). The head's `x-understudy-batch` names the batch
for `POST /v1/continuations/abort` (one member's client left). When the router's connection goes,
every member stops."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from pydantic import BaseModel, ConfigDict, Field

from wire import request_body
from wire.batch_wire import BATCH_HEADER, END, FRAMES_TYPE, BatchFormatError, WireMember, read_members
from wire.interrupt import unless_client_leaves
from wire.protocol import Continuation
from .streams import CHUNK_DELAY_S, EventStream, StreamEvents, paced

log = logging.getLogger("engines.frontend.continuation_batch")

# Members started together (one message to the core, one step). A member took the front end 0.2 ms
# of CPU on the dev VM and ~0.3 on the H200 hosts, in groups of 64 the first reached the core ~20 ms
# later than one by one (bench/RESULTS.md, sixth session); with its ids raw it takes ~0.1 and ~0.2
# (twelfth session): 16 a group keep the first member's wait to a few ms.
# The fairness group of the sequences started while a batch starts its members: the batch's own, so
# that the core takes a batch as one request (engines/core/scheduler.py FairQueue), not thousands.
BATCH_GROUP: contextvars.ContextVar[int | None] = contextvars.ContextVar("batch_group", default=None)
GROUP = 16


class BatchAbort(BaseModel):
    """Stop one member of a batch (its client left)."""

    model_config = ConfigDict(extra="forbid")
    batch: str = Field(max_length=64)
    index: int = Field(ge=0)


def frame(index: int, status: int, payload: bytes = b"") -> bytes:
    return b"%d %d %d\n" % (index, status, len(payload)) + payload


@dataclass
class BodyTiming:
    """When a batch's request arrived (its head), its body was whole and its members' frames read
    (time.monotonic): with the moment its last member went to the core, one log line a batch (a
    failover's), which says how much of the wait across a kill this front end took."""

    arrived: float
    read: float
    size: int
    parsed: float = 0.0

    def log(self, batch: str, answered: int, members: int) -> None:
        ms = lambda t: (t - self.arrived) * 1e3  # noqa: E731
        log.info("batch %s: %d of %d members answered (started or refused); its %d-byte body whole at +%.1f ms, "
                 "its frames read at +%.1f, the last member to the core at +%.1f ms after its head", batch[:8], answered,
                 members, self.size, ms(self.read), ms(self.parsed), ms(time.monotonic()))


class _Ready:
    """The members whose outputs came, in order, and the batch writer's wake-up. Apart from the Batch,
    so that a member's `Running.on_ready` holds no reference back to it: a finished batch is freed
    by reference counts, not left to the garbage collector (whose pauses stall every stream)."""

    def __init__(self) -> None:
        self.members: list[int] = []
        self.wake = asyncio.Event()

    def mark(self, index: int) -> None:
        self.members.append(index)
        self.wake.set()

    def take(self) -> list[int]:
        members, self.members = self.members, []
        return members


class Batch:
    """A batch's members, each checked and started in turn as the answer's body already flows (the
    first members' tokens need not wait for the last member's checks), framed into one body by
    this ASGI callable. `start(path, body)` answers one member (an event stream:
    engines/frontend/streams.py EventStream; or a refusal: a Response). The members' outputs are made into
    events by this batch's one writer, as they come (each member's `Running.on_ready` names it
    ready), in one write for all that came at once."""

    def __init__(self, requests: list[WireMember], start, refuse, registry: dict[str, "Batch"],
                 together: Callable[[], ContextManager[None]], timing: BodyTiming | None = None) -> None:
        self.id = uuid.uuid4().hex
        self.timing = timing
        self.requests, self.start, self.refuse, self.registry = requests, start, refuse, registry
        self.together = together
        self.members: list = []  # (started so far, in order)
        self._live: dict[int, StreamEvents] = {}  # members still streaming
        self._ready = _Ready()  # members with outputs waiting, as they came
        self._paced: dict[int, asyncio.Task] = {}  # (the test pause only: a member's own writer, see _start_one)
        self._out: list[bytes] = []
        self._wake = self._ready.wake
        self._starting = True

    async def __call__(self, scope: dict, receive, send) -> None:
        self.registry[self.id] = self
        try:
            await unless_client_leaves(self._send_all(send), receive)
        finally:
            self.registry.pop(self.id, None)
            self._starting = False
            for i in list(self._live):
                self.abort(i)

    def abort(self, index: int) -> bool:
        """Stop member `index` (its sequences aborted, no more frames); False if it was not running."""
        stream = self._live.pop(index, None)
        if stream is None:
            return False
        if (task := self._paced.pop(index, None)) is not None:
            task.cancel()
        stream.running.abort()
        return True

    async def _send_all(self, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", FRAMES_TYPE), (BATCH_HEADER, self.id.encode())]})
        starting = asyncio.ensure_future(self._start_all())
        try:
            while self._starting or self._live or self._out:
                if not self._out and not self._ready.members:
                    await self._wake.wait()
                self._wake.clear()
                self._relay()
                body, self._out = b"".join(self._out), []
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            starting.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _relay(self) -> None:
        """The events of every member whose outputs came, a frame each, and the ends of those that ended."""
        for index in self._ready.take():
            stream = self._live.get(index)
            if stream is None:  # (aborted meanwhile)
                continue
            try:
                events = stream.feed(stream.running.take())
            except Exception:  # noqa: BLE001 (a bug in one member's stream ends just it)
                log.exception("continuation %d of batch %s failed", index, self.id)
                events = None
            if events:
                self._out.append(frame(index, 200, b"".join(events)))
            if events is None or stream.ended:
                self._end(index)

    def _end(self, index: int) -> None:
        stream = self._live.pop(index)
        stream.running.abort()
        self._out.append(frame(index, END))
        self._wake.set()

    async def _start_all(self) -> None:
        """The members in order, as their own requests would be, GROUP at a time: a group's
        sequences reach the core in one message (`together`) and start in one step. The groups go
        back to back, the started members' frames only after the last: relaying the first ones'
        outputs between groups held the last group back (on the dev VM, 256 members reached the core
        in 17-20 ms so, in 23-63 ms with the frames relayed between groups; H100 logs: 20-38 ms)."""
        BATCH_GROUP.set(id(self))  # (this task's context only)
        try:
            for first in range(0, len(self.requests), GROUP):
                with self.together():
                    for i in range(first, min(first + GROUP, len(self.requests))):
                        if not self._starting:
                            return
                        await self._start_one(i, self.requests[i])
        finally:
            self._starting = False
            self._wake.set()
            if self.timing is not None:
                self.timing.log(self.id, len(self.members), len(self.requests))

    async def _start_one(self, i: int, m: WireMember) -> None:
        data = member_body(i, m)
        answer = await self.start(m.path, data) if isinstance(data, dict) else self.refuse(400, *data)
        self.members.append(answer)
        if not isinstance(answer, EventStream):
            self._out.append(frame(i, answer.status_code, bytes(answer.body)))
            self._wake.set()
            return
        stream = self._live[i] = answer.events
        if CHUNK_DELAY_S:
            self._paced[i] = asyncio.ensure_future(self._pace(i, stream))
            return
        stream.running.on_ready = functools.partial(self._ready.mark, i)
        if opening := stream.opening():
            self._out.append(frame(i, 200, b"".join(opening)))
            self._wake.set()
        if stream.running.waiting:
            self._ready.mark(i)

    async def _pace(self, index: int, stream: StreamEvents) -> None:
        """(Tests only: UNDERSTUDY_TEST_CHUNK_DELAY_S.) A member's events one at a time with the pause
        after each, as its own request's stream would go (engines/frontend/streams.py `paced`)."""
        try:
            async for event, _ in paced(stream):
                self._out.append(frame(index, 200, event))
                self._wake.set()
        except Exception:  # noqa: BLE001
            log.exception("continuation %d of batch %s failed", index, self.id)
        self._paced.pop(index, None)
        if index in self._live:
            self._end(index)


def member_body(i: int, m: WireMember) -> dict | tuple[str, str]:
    """Member `i`'s request body as its own request would carry it (a continuation's ids, read raw,
    as its `continuation`), or why it is refused: (message, param)."""
    try:
        data = request_body.loads(m.json)
    except request_body.BodyError as e:
        return f"requests.{i}: {e.message}", f"requests.{i}.body"
    if not isinstance(data, dict) or data.get("stream") is not True:
        return f"requests.{i}: a batch holds streamed requests only (a JSON object with stream: true)", \
            f"requests.{i}.body.stream"
    if m.prompt_ids is not None:
        if "continuation" in data:
            return f"requests.{i}: its ids are framed; its body holds no continuation of its own", \
                f"requests.{i}.body.continuation"
        # (a model instance passes validation as it is: the ids are checked by the endpoint, as arrays)
        data["continuation"] = cont = Continuation.model_construct(prompt_token_ids=m.prompt_ids,
                                                                   output_token_ids=m.output_ids)
        cont._router_keys = m.keys
    return data


async def serve_batch(body: bytes, start, refuse, registry: dict[str, Batch], together,
                      timing: BodyTiming | None = None):
    """The answer to a batch's body (wire/batch_wire.py): a Batch whose members `start(path, data)`
    answers (each an event stream, or its refusal), or `refuse(status, message, param)` for a body
    that is not a batch. A member is any streamed request: a continuation, or a request the failover
    re-sends before its first token (the router knew no ids to continue from). `together()`: a block
    whose members' sequences reach the core at once (engines/frontend/engine_client.py)."""
    try:
        members = read_members(body)
    except BatchFormatError as e:
        return refuse(400, f"not a batch of continuations: {e.message}", e.param)
    if timing is not None:
        timing.parsed = time.monotonic()
    return Batch(members, start, refuse, registry, together, timing)


def abort_member(data: Any, registry: dict[str, Batch], refuse):
    """`POST /v1/continuations/abort`: (status, body) for stopping one member of a running batch."""
    try:
        req = BatchAbort.model_validate(data)
    except ValueError as e:
        return refuse(400, f"not an abort of a batch member: {e}", None)
    batch = registry.get(req.batch)
    if batch is None:
        return refuse(404, f"no batch {req.batch!r} is running here (it ended, or never was)", "batch")
    if req.index >= len(batch.requests):
        return refuse(400, f"batch {req.batch} has {len(batch.requests)} members; no index {req.index}", "index")
    return {"aborted": batch.abort(req.index)}
