"""The continuations of one failover, sent to the new primary as one request (engines/frontend/continuation_batch.py
says why and gives the frames), up to the engines' body limit a request; each gets a Response-like view
of its own part of the answer, so that the continuation loop (supervisor/router/migrating.py) reads it
as it reads a response of its own.

Two ways in. A continuation that lost its primary while none serves (a failover's promotion under
way) waits with its member built (`at_next_primary`): the routing table's change that brings the next
primary sends every such member at once, from the supervisor's pass itself. Before, each went once its
request's task had run again: a failover woke 256 of them at once, and their batch left once the last
had run (~12 ms on an H200 host, bench/RESULTS.md). The others (`request`) go together when they ask
for the same primary in the same pass of the event loop.

A batch runs under its primary's epoch (routing.RoutingTable.unless_lost): one fenced before or while
its batch goes fails its members at once, and none reaches an engine after its fence."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from wire import sse
from wire.batch_wire import BATCH_HEADER, END, FRAMES_TYPE
from supervisor.router.http_wire import Headers, RemoteProtocolError, UpstreamError, UpstreamTimeout
from supervisor.router.idle_guard import IdleGuard
from supervisor.router.routing import PrimaryLost, RoutingTable, Upstream
from supervisor.router.upstream import Client, Sent

log = logging.getLogger("understudy.router")

BATCH_PATH = b"/v1/continuations"
ABORT_PATH = "/v1/continuations/abort"
ABORT_TIMEOUT_S = 5.0
WARM_EVERY_S = 1.0  # how often the connection to the next primary is checked (Client.warm renews it)
JSON: Headers = [(b"content-type", b"application/json")]
FRAMES: Headers = [(b"content-type", FRAMES_TYPE)]
SSE: Headers = [(b"content-type", b"text/event-stream")]


class Member:
    """One continuation's part of a batch, read as a Response (supervisor/router/upstream_response.py):
    `status`, `headers`, `read()` (a refusal's body), `stream()` (its event stream), `finish()`, `close()`."""

    def __init__(self, frame: bytes, timeout_s: float, ran: Callable[[], None] | None = None) -> None:
        self.frame, self.timeout_s = frame, timeout_s  # (its part of the batch's body: wire/batch_wire.py)
        self._ran = ran  # called when the engine's scheduled marker arrives (it began running this one)
        self.status, self.headers = 0, SSE
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent_to: Upstream | None = None  # sent at a routing change (Batcher.at_next_primary): where
        self.sent_at = 0.0  # ... and when (time.monotonic)
        self.ended = False  # the engine sent all of it (or failed it)
        self._abort: Callable[[], None] | None = None  # stops this member in the engine, once its batch runs
        self._abort_due = False  # closed unfinished before its batch ran: stopped as it runs
        self._chunks: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._error: UpstreamError | None = None
        self._refusal = b""
        self._closed = False
        self._guard = IdleGuard(timeout_s, self._wake.set)

    @property
    def is_event_stream(self) -> bool:
        return self.status == 200

    def bind_abort(self, abort: Callable[[], None]) -> None:
        """Its batch runs in the engine: `abort` stops this member there (now, if it was closed unfinished)."""
        self._abort = abort
        if self._abort_due:
            self._abort_due = False
            abort()

    def answer(self) -> "Member":
        """This member, its head in; its failure raised if it failed before its first frame."""
        if self.status == 0:
            raise self.error()
        return self

    def take(self, status: int, payload: bytes) -> None:
        """A frame for this member (from the batch's reader)."""
        if self.ended:
            return
        if status == END:
            self.ended = True
        elif status == 200:
            self._chunks.append(payload)
            if self._ran is not None and sse.SCHEDULED in payload:
                # Said at once, not when the continuation's task reads it: a loss of this primary in
                # the same pass of the loop must count it as run there (quarantine).
                self._ran()
                self._ran = None
        else:
            self.status, self.headers, self._refusal, self.ended = status, JSON, payload, True
        if not self.head.done():
            self.status = self.status or 200
            self.head.set_result(None)
        self._wake.set()

    def fail(self, error: UpstreamError) -> None:
        """The batch's answer broke (or ended) before this member's end."""
        if self.ended:
            return
        self.ended, self._error = True, error.with_traceback(None)
        if not self.head.done():
            self.head.set_result(None)  # (request() raises the error: a future would keep it, see error())
        self._wake.set()

    def error(self) -> UpstreamError:
        """This member's failure, a new exception each time it is raised: a raised exception's
        traceback holds the frames it passed, this member among their locals, and the members of a
        batch share one failure (kept, it would hold them all in one reference cycle)."""
        assert self._error is not None
        return type(self._error)(*self._error.args)

    async def read(self) -> bytes:
        if self.status != 200:
            return self._refusal
        return b"".join([chunk async for chunk in self.stream()])

    async def stream(self) -> AsyncIterator[bytes]:
        """Its event stream as it arrives (what has arrived, joined); each wait bounded by the
        timeout (supervisor/router/idle_guard.py)."""
        while True:
            if self._chunks:
                chunk = b"".join(self._chunks)
                self._chunks.clear()
                yield chunk
                continue
            if self.ended:
                self._guard.stop()
                if self._error is not None:
                    raise self.error()
                return
            self._wake.clear()
            self._guard.begin()
            try:
                await self._wake.wait()
            finally:
                self._guard.end()
            if self._guard.timed_out:
                self.close()
                raise UpstreamTimeout(f"no bytes of this continuation within {self.timeout_s:g}s")

    async def finish(self, timeout_s: float) -> None:
        """After [DONE]: its end is the engine's to frame; nothing to wait for."""

    def close(self) -> None:
        """Done with it: an unfinished member is stopped in the engine (its client left, or it was fenced)."""
        if self._closed:
            return
        self._closed = True
        self._guard.stop()
        if not self.ended:
            if self._abort is not None:
                self._abort()
            else:
                self._abort_due = True
        self.ended = True


class Batcher:
    """``await batcher.request(up, frame)``: a Member once its first frame is in (as
    ``Client.request`` returns once a response head is in); ``await batcher.at_next_primary(...)``:
    one sent when the next primary comes."""

    def __init__(self, client: Client, table: RoutingTable, max_bytes: int, timeout_s: float) -> None:
        self.client, self.table, self.max_bytes, self.timeout_s = client, table, max_bytes, timeout_s
        self._pending: dict[Upstream, list[Member]] = {}
        self._early: dict[Member, int | None] = {}  # waiting for the next primary (in order): the epoch not to take
        self._running: set[asyncio.Task] = set()
        self._warm_timer: asyncio.TimerHandle | None = None
        table.on_change.append(self._on_change)
        table.on_next.append(self._keep_warm)

    async def request(self, up: Upstream, frame: bytes, ran: Callable[[], None] | None = None) -> Member:
        """``frame``: the request as a member of the batch (continuation.py `Tracked.batch_member`);
        ``ran``: called as the engine's scheduled marker for this member arrives."""
        member = Member(frame, self.timeout_s, ran)
        pending = self._pending.get(up)
        if pending is None:
            pending = self._pending[up] = []
            asyncio.get_running_loop().call_soon(self._send, up)  # after the others woken in this pass
        pending.append(member)
        await self._answered(member)
        return member.answer()

    async def at_next_primary(self, frame: Callable[[], bytes], ran: Callable[[], None] | None,
                              not_epoch: int | None, until: float) -> Member | None:
        """A member (its frame: ``frame()``) sent by the routing table's change that brings a primary
        (of an epoch other than ``not_epoch``), returned once its first frame is in (or it failed:
        ``Member.answer``), the primary it went to in ``sent_to``. None when a primary is there
        already, or none came by ``until`` (monotonic), or the router is stopping: nothing was sent,
        the request waits the usual way (supervisor/router/attempts.py)."""
        table = self.table
        if table.stopping or (table.primary is not None and table.primary.epoch != not_epoch):
            return None
        member = Member(frame(), self.timeout_s, ran)
        self._early[member] = not_epoch
        timer = asyncio.get_running_loop().call_later(max(until - time.monotonic(), 0.0), self._unsent, member)
        try:
            await self._answered(member)
        finally:
            timer.cancel()
        return member if member.sent_to is not None else None

    async def _answered(self, member: Member) -> None:
        try:
            await member.head
        except BaseException:  # (its request ended: its client left)
            self._early.pop(member, None)
            member.close()
            raise

    def _unsent(self, member: Member) -> None:
        """``member``'s wait for the next primary is over, unsent: its request goes the usual way."""
        if member in self._early:
            del self._early[member]
            member.head.set_result(None)

    def _on_change(self) -> None:
        """The routing table changed: the members waiting for a primary go to the new one now (the
        router stopping: they go the usual way, to their 503)."""
        if not self._early:
            return
        up = self.table.primary
        if self.table.stopping:
            for member in list(self._early):
                self._unsent(member)
            return
        if up is None:
            return
        members = [m for m, not_epoch in self._early.items() if not_epoch != up.epoch]
        now = time.monotonic()
        for m in members:
            del self._early[m]
            m.sent_to, m.sent_at = up, now
        self._start(up, members)

    def _keep_warm(self) -> None:
        """A connection to the next primary kept open (Client.warm), checked every WARM_EVERY_S while
        there is one: a failover's continuations are written on it from the routing change itself."""
        if self._warm_timer is not None:
            self._warm_timer.cancel()
            self._warm_timer = None
        url = self.table.next_primary
        if url is None or self.table.stopping:
            return
        self.client.warm(url)
        self._warm_timer = asyncio.get_running_loop().call_later(WARM_EVERY_S, self._keep_warm)

    def _send(self, up: Upstream) -> None:
        self._start(up, self._pending.pop(up))

    def _start(self, up: Upstream, members: list[Member]) -> None:
        """Each batch written now where a connection to ``up`` is idle (one kept warm: ``warm``), else
        once its task runs; its answer read by its task."""
        for batch in self._split(members):
            if batch:
                body = b"".join(m.frame for m in batch)
                sent = self.client.send_now("POST", up.url, BATCH_PATH, FRAMES, body)
                task = asyncio.ensure_future(self._run(up, batch, body, sent))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    def _split(self, members: list[Member]) -> list[list[Member]]:
        """Batches whose bodies fit the engines' limit (a member over it alone: refused as it would be alone)."""
        out: list[list[Member]] = [[]]
        size = 0
        for m in members:
            n = len(m.frame)
            if out[-1] and size + n > self.max_bytes:
                out.append([])
                size = 0
            out[-1].append(m)
            size += n
        return out

    async def _run(self, up: Upstream, members: list[Member], body: bytes, sent: Sent | None) -> None:
        """One batch, as long as its primary is not fenced: a fence fails its members at once."""
        try:
            await self.table.unless_lost(up.epoch, self._exchange(up, members, body, sent))
        except PrimaryLost:
            for m in members:
                m.fail(UpstreamError(f"{up.name} (epoch {up.epoch}) was fenced before this continuation's end"))
        finally:
            if sent is not None and not sent.awaited:  # (fenced before its exchange began: never read)
                self.client.abandon(sent)

    async def _exchange(self, up: Upstream, members: list[Member], body: bytes, sent: Sent | None) -> None:
        """One batch to ``up``: sent (``sent``: written already), its frames dealt to its members; any
        failure fails those not ended."""
        resp = None
        try:
            resp = await (self.client.response(sent) if sent is not None else
                          self.client.request("POST", up.url, BATCH_PATH, FRAMES, body))
            if resp.status != 200 or resp.header(b"content-type") != FRAMES_TYPE:
                content = await resp.read()
                for m in members:  # (the engine refused the batch: each member as its own request would be)
                    m.take(resp.status if resp.status != 200 else 502, content)
                return
            batch = (resp.header(BATCH_HEADER) or b"").decode()
            for i, m in enumerate(members):
                m.bind_abort(lambda i=i: self._abort(up, batch, i))
            await self._deal(resp, members)
            error: UpstreamError = RemoteProtocolError("the batch's answer ended before this continuation's end")
        except UpstreamError as e:
            error = e
        except ValueError as e:  # a malformed frame
            error = RemoteProtocolError(f"malformed batch frame: {e}")
        except BaseException:  # (its primary fenced, or the router stopping)
            for m in members:
                m.fail(UpstreamError("this batch of continuations was stopped (its primary fenced, or the router "
                                     "stopping)"))
            raise
        finally:
            if resp is not None:
                resp.close()
        for m in members:
            m.fail(error)

    async def _deal(self, resp, members: list[Member]) -> None:
        """Read frames until the body ends or every member is done. (A chunk holds a frame per
        running member per step: each is cut at an offset, what is left kept once per chunk.)"""
        buf = b""
        async for chunk in resp.stream():
            buf, at = buf + chunk if buf else chunk, 0
            while (nl := buf.find(b"\n", at)) >= 0:
                index, status, length = map(int, buf[at:nl].split(b" "))
                end = nl + 1 + length
                if end > len(buf):
                    break
                if not 0 <= index < len(members) or length < 0:
                    raise ValueError(f"frame for member {index} of {len(members)}, {length} bytes")
                members[index].take(status, buf[nl + 1:end])
                at = end
            buf = buf[at:]
            if all(m.ended for m in members):
                return

    def _abort(self, up: Upstream, batch: str, index: int) -> None:
        """Stop member ``index`` in the engine, unless its batch's primary (``up``) was fenced: the fence
        interrupts the batch's own call, whose end closes its connection and so stops every member. (A
        fence used to send the dead engine an abort for each member whose task ran before the batch's:
        20 of 64 at one fence on the dev VM, bench/RESULTS.md.)"""
        if self.table.is_lost(up.epoch):
            return
        task = asyncio.ensure_future(self._send_abort(up.url, batch, index))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _send_abort(self, url: str, batch: str, index: int) -> None:
        try:
            await self.client.fetch("POST", url, ABORT_PATH, {"batch": batch, "index": index}, ABORT_TIMEOUT_S)
        except UpstreamError as e:  # (its engine is gone: so is the member)
            log.debug("abort of continuation %d of batch %s: %s", index, batch, e)
