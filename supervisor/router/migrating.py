"""The router's continuation loop: serve one continuable request (supervisor/router/continuation.py), and
when its primary is lost mid-request, continue it on the new primary and splice the answer.

Rules (DESIGN.md §4, issues 11 and 12):
- a failure after the request was sent, on a primary that then goes away, is a migration: the new
  primary gets the continuation (prompt + emitted ids, same seed), at most `max_migrations` times
  and `max_replay_tokens` long;
- a request running on two primaries (epochs) when they failed, with no new token in between, is
  quarantined: failed with a clear error, never sent to a third engine (a poison request). Running
  means the engine had begun computing it: its stream carried the engine's scheduled marker
  (wire/sse.py SCHEDULED, sent before the step that first runs it) or a token. A request that an
  engine only answered and queued (behind max_num_seqs others), or never answered, did not kill it;
- on an external engine, the continuation takes the path the new primary takes (supervisor/router/abilities.py:
  token ids, or a replay by text); one it cannot take ends as the next rule says;
- a request that cannot be continued ends explicitly: an SSE error event and an aborted connection
  once bytes went to the client, an HTTP error before. Never a silent truncation;
- a streaming client never waits in silence: one given no byte for KEEP_ALIVE_S gets a comment (the
  200 head first, if none went), as its request waits behind max_num_seqs others in the engine, or its
  continuation does; not while it is held for a primary with nothing sent (that answer may be a 503).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from wire import sse
from supervisor.config import MigrationSection
from supervisor.router.abilities import Abilities
from supervisor.router.attempts import SAME_PRIMARY_RETRY_S, Attempts, Upstreams
from supervisor.router.batching import Batcher, Member

EVIDENCE_WAIT_S = 1.0  # how long a twice-lost request waits for its engines' exit statuses (then: counted)
from supervisor.router.continuation import Tracked, error_event
from supervisor.router.relay_watch import RelayWatch
from supervisor.router.replies import Send
from supervisor.router.routing import PrimaryLost, Upstream
from supervisor.router.upstream import NOT_RELAYED, ConnectError, Headers, UpstreamError, UpstreamTimeout

log = logging.getLogger("understudy.router")

Publish = Callable[[dict[str, Any]], None]
STREAM_END_WAIT_S = 0.25  # [DONE] -> the end of the engine's chunked body (sent right after it)
# A continuation's moments, as published in its migration event (time.monotonic, the host's clock):
# the primary was lost, the continuation was sent to the new one, the engine's response head came, the
# first new token (or the end) came.
TIMELINE = ("lost", "sent", "answered", "token")
# A request queued behind max_num_seqs others waits for its first token as long as they take: the last of
# 32 streams of 900 tokens at max_num_seqs 2, continued after two SIGKILLs on the CPU test node, ~60 s, and
# a client's read timeout (httpx's, 60 s there) ended it with nothing received. Checked every third of it.
KEEP_ALIVE_S = 15.0
KEEP_ALIVE = b": keep-alive\n\n"


class StreamAborted(Exception):
    """A streaming answer that cannot be completed: the connection is aborted after an error event."""


class _Refused(Exception):
    """The engine answered the (continued) request with something other than a stream."""

    def __init__(self, status: int, headers: Headers, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.headers, self.body = status, headers, body


class Migrator:
    """Serves Tracked requests (with the table, client, metrics and hold policy of ``upstreams``)."""

    def __init__(self, upstreams: Upstreams, cfg: MigrationSection, publish: Publish | None,
                 max_body_bytes: int, key_chain: tuple[bytes, int] | None = None, external: bool = False) -> None:
        """``key_chain``: the engines' block keys' (key root, block size), as EngineClient's: a batch
        member carries its prompt's keys. ``external``: the engines are external (no batches; the text
        sent is kept for a replay)."""
        self.u, self.cfg, self.publish, self.external = upstreams, cfg, publish, external
        self.key_chain = key_chain if cfg.batch else None
        self.batcher = Batcher(upstreams.client, upstreams.table, max_body_bytes, upstreams.upstream_timeout_s) \
            if cfg.batch else None
        m = upstreams.metrics
        self._results = {r: m.migrations.labels(result=r) for r in
                         ("continued", "failed", "quarantined", "unsupported", "limit")}
        self._live: set[_Call] = set()
        self._ticker: asyncio.TimerHandle | None = None  # _keep_alive's, while requests are served
        upstreams.table.on_lost.append(self._unregistered)

    async def serve(self, req: Tracked, target: bytes, headers: Headers, send: Send) -> None:
        """The whole exchange with our client for one request."""
        call = _Call(self, req, target, headers, send)
        self._live.add(call)
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(KEEP_ALIVE_S / 3, self._keep_alive)
        try:
            await call.run()
        finally:
            self._live.discard(call)

    def _keep_alive(self) -> None:
        """Every third of KEEP_ALIVE_S while requests are served: a comment to each streaming client
        that waited that long (_Call.keep_alive)."""
        self._ticker = None
        if not self._live:
            return
        now = time.monotonic()
        for call in self._live:
            call.keep_alive(now)
        self._ticker = asyncio.get_running_loop().call_later(KEEP_ALIVE_S / 3, self._keep_alive)

    def _unregistered(self, epoch: int, interrupted: set) -> None:
        """A fence of ``epoch``'s primary: the requests with an attempt in flight there whose task it did
        not interrupt would wait for the dead engine's sockets: say how many and where they wait. (A GPU
        run once continued 158 streams ~240 ms late, why not shown: bench/RESULTS.md, twenty-sixth
        session. Fences that interrupted fewer calls than streams, with no such request, are streams
        whose sockets closed first: they were between attempts, and continued on time.)"""
        tasks = {i.task for i in interrupted}
        missed = [c for c in self._live if c.attempt_on == epoch and not c.req.done and c.task not in tasks]
        if missed:
            where = Counter(_waiting_in(c.task) for c in missed)
            log.warning("epoch %d fenced: %d requests in flight there not interrupted; their tasks wait in: %s",
                        epoch, len(missed), "; ".join(f"{n}x {w}" for w, n in where.most_common(4)))

    def count(self, result: str, req: Tracked, stall_s: float | None = None, replayed: int | None = None,
              chunks_before: int | None = None, timeline: dict[str, float] | None = None) -> None:
        self._results[result].inc()
        if stall_s is not None:
            self.u.metrics.migration_stall.observe(stall_s)
        if self.publish is not None:
            self.publish({"type": "migration", "result": result, "request_id": req.rid or "",
                          "tokens_replayed": req.n_output if replayed is None else replayed, "stall_s": stall_s,
                          "chunks_before": req.chunks_sent if chunks_before is None else chunks_before,
                          "timeline": timeline, "ts": time.time()})


def _waiting_in(task: asyncio.Task | None) -> str:
    """Where a suspended task waits: its chain of awaited coroutines, innermost first (3 at most)."""
    where, coro = [], task.get_coro() if task is not None else None
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        where.append(f"{coro.cr_code.co_name}:{coro.cr_frame.f_lineno}")
        coro = coro.cr_await
    return " < ".join(reversed(where[-3:])) or "?"


class _Call:
    """One request's attempts, from its first send to its last byte."""

    def __init__(self, m: Migrator, req: Tracked, target: bytes, headers: Headers, send: Send) -> None:
        self.m, self.req, self.target, self.headers, self.send = m, req, target, headers, send
        self.started = False  # the response head went to our client
        self.began = False  # a data chunk went to our client (its answer began, as it times it)
        self.served_epoch: int | None = None  # the primary that sent our client's last data chunk
        self.last_sent = time.monotonic()  # our client's last byte (a non-streaming one: last chunk read)
        self.migrating_since: float | None = None  # last_sent when the current continuation began
        self.failed_epochs: set[int] = set()  # primaries lost running this request, since its last new token
        self.migrations = 0
        self.replayed = 0  # tokens the current continuation replays
        self.chunks_before = 0  # data chunks our client had when the current continuation began
        self.epoch = 0
        self.timeline: dict[str, float] = {}  # the current continuation's moments (time.monotonic): TIMELINE
        self.headers_out: Headers = []  # engine headers for a non-streaming client's response
        self.early: Member | None = None  # the continuation, sent as the next primary came (_send_early)
        self.task = asyncio.current_task()
        self.attempt_on: int | None = None  # the epoch of the attempt in flight (None between attempts: lost)
        self.abilities: Abilities | None = None  # the last attempt's engine's, if external (supervisor/router/abilities.py)
        self.held = False  # waiting for a primary to send the request to (Attempts.primary)
        self.sending = False  # a message of ours is on its way to our client (_send)
        self.keeping: asyncio.Task | None = None  # a keep-alive is (keep_alive)
        self.kept_at = 0.0  # our client's last keep-alive (time.monotonic)

    async def run(self) -> None:
        u = self.m.u
        attempts = u.attempts()
        while (up := await self._primary(attempts)) is not None:
            self.epoch, early, self.early = up.epoch, self.early, None
            self.abilities = up.abilities
            try:
                self.attempt_on = up.epoch
                try:
                    await attempts.call(up, self._attempt(up, early))
                finally:
                    self.attempt_on = None
                return await self._finish()
            except _Refused as r:
                if attempts.may_retry(r.status):
                    attempts.failed(up, f"HTTP {r.status}")
                    continue
                return await self._refused(r, up)
            except UpstreamTimeout:
                return await self._give_up("failed" if self.migrations else None, 504, u.timed_out(up.name))
            except (UpstreamError, PrimaryLost) as e:
                attempts.failed(up, e)
                if isinstance(e, ConnectError):  # never reached the engine: a plain retry
                    continue
            if self.req.ran:
                self._lost_with(up.epoch)
            if self.req.done:
                return await self._finish()
            if self.req.finish_reason is not None:  # lost after its last token: nothing to continue
                if self.req.client_stream:
                    await self._body(self.req.finish_locally())
                return await self._finish()
            if (why := await self._why_not()) is not None:
                return await self._give_up(*why)
            self.migrations += 1
            self.migrating_since, self.replayed = self.last_sent, self.req.n_output
            self.chunks_before = self.req.chunks_sent
            self.timeline = {"lost": time.monotonic()}
            attempts.hold_again()
            await self._send_early(attempts)
        return await self._give_up("failed" if self.migrations else None, 503, attempts.unavailable())

    async def _primary(self, attempts: Attempts) -> Upstream | None:
        """Where the next attempt goes: where the continuation went already, else the primary."""
        if self.early is not None:
            return self.early.sent_to
        self.req.ran = False  # (an attempt fenced before it ran took nothing)
        self.held = True
        try:
            return await attempts.primary()
        finally:
            self.held = False

    async def _send_early(self, attempts: Attempts) -> None:
        """While no primary serves (a promotion under way), the continuation waits built, and goes with
        the failover's others at the routing change that brings the next primary (Batcher.at_next_primary);
        up to SAME_PRIMARY_RETRY_S, then the usual wait."""
        if self.m.batcher is None:
            return
        self.req.ran = False
        began = time.monotonic()
        self.early = await self.m.batcher.at_next_primary(self._member, self._ran, attempts.failed_epoch,
                                                          min(attempts.deadline, began + SAME_PRIMARY_RETRY_S))
        if self.early is not None:
            attempts.held(self.early.sent_at - began)

    def _member(self) -> bytes:
        return self.req.batch_member(self.target.partition(b"?")[0])

    def _ran(self) -> None:
        self.req.ran = True

    def _moment(self, name: str, now: float | None = None) -> None:
        """Note the first `name` moment of the current continuation (none before the first loss)."""
        if self.migrating_since is not None and name not in self.timeline:
            self.timeline[name] = time.monotonic() if now is None else now

    def _lost_with(self, epoch: int) -> None:
        """The primary of `epoch` failed while working on this request."""
        if self.req.progress:
            self.failed_epochs.clear()
        self.failed_epochs.add(epoch)

    async def _why_not(self) -> tuple[str, int, str] | None:
        """Why this request must not be sent again after losing its primary, if so. A quarantine needs
        evidence: engines SIGKILLed from outside (the exit status says so) do not count against it."""
        req, cfg = self.req, self.m.cfg
        req.progress = False
        if (why := req.not_continuable(self.abilities)) is not None:
            return ("unsupported", 502, f"the engine was lost mid-response and this request cannot be continued: {why}")
        if len(self.failed_epochs) >= 2:
            table = self.m.u.table
            for epoch in sorted(self.failed_epochs):
                if not await table.loss_evidence(epoch, EVIDENCE_WAIT_S):
                    self.failed_epochs.discard(epoch)
        if len(self.failed_epochs) >= 2:
            return ("quarantined", 502, f"request quarantined: it was running on each of the {len(self.failed_epochs)} "
                                        f"engines that failed, with no token generated in between (a request "
                                        f"that kills engines is not sent to another)")
        if self.migrations >= cfg.max_migrations:
            return ("limit", 502, f"the engine was lost mid-request and this request was already continued "
                                  f"router.migration.max_migrations={cfg.max_migrations} times")
        if req.replay_tokens > cfg.max_replay_tokens:
            return ("limit", 502, f"the engine was lost mid-request; continuing it would replay "
                                  f"{req.replay_tokens} tokens, over router.migration.max_replay_tokens="
                                  f"{cfg.max_replay_tokens}")
        return None

    async def _attempt(self, up: Upstream, early: Member | None = None) -> None:
        """Send the request (or its continuation) to `up` and relay its stream until [DONE] (``early``:
        the continuation went already, its head is in)."""
        u, req, batcher = self.m.u, self.req, self.m.batcher
        self._moment("sent", early.sent_at if early is not None else None)
        if early is not None:
            resp = early.answer()
        elif self.migrations and batcher is not None and up.abilities is None:  # (a failover's continuations go together)
            resp = await batcher.request(up, self._member(), self._ran)
        else:
            resp = await u.client.request("POST", up.url, self.target, self.headers, req.upstream_body(up.abilities))
        self._moment("answered")
        try:
            if resp.status != 200 or not resp.is_event_stream:
                raise _Refused(resp.status, resp.headers, await resp.read())
            engine_headers = [(b"x-understudy-engine", up.name.encode()),
                              (b"x-understudy-epoch", str(up.epoch).encode())]
            watch = RelayWatch(self, up)  # (stalls, the first token, a continuation's: supervisor/router/relay_watch.py)
            async for chunk in resp.stream():
                watch.came()
                out = req.feed(chunk)
                if req.done:  # the connection goes back to the pool before our client hears [DONE]
                    await resp.finish(STREAM_END_WAIT_S)
                now = time.monotonic()
                watch.fed(now)
                if req.client_stream:
                    if out:
                        if not self.started:
                            await self._head(engine_headers)
                        self.began = True
                        if self.served_epoch != up.epoch:  # its first chunk from this primary, as the client times
                            self.served_epoch = up.epoch  # it (a continuation's: maybe a new primary's first success)
                            u.served(up.epoch, 200, now)
                        await self._send({"type": "http.response.body", "body": out, "more_body": True})
                        self.last_sent = now
                else:
                    self.last_sent = now
                    self.headers_out = engine_headers
                watch.relayed(now)
            if not req.done:
                raise UpstreamError("the engine's stream ended without [DONE]")
        finally:
            resp.close()

    async def _finish(self) -> None:
        """The answer is whole: end the stream, or send the one response."""
        u, req = self.m.u, self.req
        if req.client_stream:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            body = req.whole_response()
            u.count_status(200)
            await self._send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                *self.headers_out]})
            await self._send({"type": "http.response.body", "body": body})
            u.served(self.epoch, 200)

    async def _body(self, data: bytes) -> None:
        if not self.started:
            await self._head()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def _head(self, headers: Headers = ()) -> None:
        await self._send(self._head_message(headers))

    def _head_message(self, headers: Headers = ()) -> dict:
        """The 200 head of our streaming client's answer, counted as sent."""
        self.started = True
        self.m.u.count_status(200)
        return {"type": "http.response.start", "status": 200, "headers": [*sse.HEADERS, *headers]}

    async def _send(self, message: dict) -> None:
        """A message to our client, after the keep-alive on its way if one is (never beside it)."""
        if self.keeping is not None:
            await asyncio.wait((self.keeping,))
        self.sending = True
        try:
            await self.send(message)
        finally:
            self.sending = False

    def keep_alive(self, now: float) -> None:
        """(Migrator's ticker.) A streaming client given no byte for KEEP_ALIVE_S gets a comment, after the
        200 head if none went; not while it is held for a primary with nothing sent, nor beside a message
        of ours (_send)."""
        if not self.req.client_stream or self.sending or self.keeping is not None or (self.held and not self.started) \
                or now - max(self.last_sent, self.kept_at) < KEEP_ALIVE_S:
            return
        self.kept_at = now
        self.keeping = asyncio.ensure_future(self._keep(None if self.started else self._head_message()))
        self.keeping.add_done_callback(self._kept)

    async def _keep(self, head: dict | None) -> None:
        if head is not None:
            await self.send(head)
        await self.send({"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True})

    def _kept(self, task: asyncio.Task) -> None:
        self.keeping = None
        if not task.cancelled() and task.exception() is not None:  # (retrieved: our next send meets it too)
            log.warning("request %s: a keep-alive to its client failed: %r", self.req.rid, task.exception())

    async def _refused(self, r: _Refused, up: Upstream) -> None:
        """The engine refused: before any byte went out (the first attempt, or an external engine's answer to
        the request re-sent as it came: nothing was sent yet), pass its answer on (an external engine may also
        answer a stream with one whole response)."""
        if not self.started and (not self.migrations or (self.abilities is not None and not self.req.n_output)):
            self.m.u.count_status(r.status)
            headers = [(k, v) for k, v in r.headers if k not in NOT_RELAYED]
            headers += [(b"x-understudy-engine", up.name.encode()), (b"x-understudy-epoch", str(up.epoch).encode())]
            body = self.req.in_client_terms(r.body) if 400 <= r.status < 500 else r.body
            await self._send({"type": "http.response.start", "status": r.status, "headers": [
                *headers, (b"content-length", str(len(body)).encode())]})
            await self._send({"type": "http.response.body", "body": body})
            return
        detail = self.req.in_client_terms(r.body)[:300].decode(errors="replace")
        if not self.migrations:  # (a keep-alive's head went before the engine answered)
            return await self._give_up(None, 502, f"the engine refused the request: HTTP {r.status} {detail}")
        await self._give_up("failed", 502, f"the new primary refused the continuation: HTTP {r.status} {detail}")

    async def _give_up(self, result: str | None, status: int, message: str) -> None:
        """End the request with an explicit error (counted as a migration `result` if one)."""
        if result is not None:
            self.m.count(result, self.req)
            log.warning("request %s not continued (%s): %s", self.req.rid, result, message)
        type_ = "migration_failed" if result else ("timeout" if status == 504 else "unavailable")
        if self.started:  # bytes went out: say so in the stream, then abort the connection
            await self._send({"type": "http.response.body", "body": error_event(message, type_, status),
                              "more_body": True})
            raise StreamAborted(message)
        self.m.u.count_status(status)
        body = json.dumps({"error": {"message": message, "type": type_, "code": status}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 503:
            headers.append((b"retry-after", str(self.m.u.retry_after_s).encode()))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
