"""``/v1/*``: OpenAI requests proxied to the primary, streams passed through. A request whose upstream
failed before the first response byte is tried again on the (new) primary, and requests wait for a
primary during a failover, then get 503 + Retry-After (supervisor/router/attempts.py). Completions
and chat completions (n=1) are continued on the new primary when theirs is lost mid-request
(supervisor/router/migrating.py); only their bodies are parsed.

A bare ASGI callable and the lean client of supervisor/router/upstream.py: every request pays for
this path, so no framework routing or request/response objects on it."""
from __future__ import annotations

import logging
import time

from wire.interrupt import unless_client_leaves
from wire.limits import RequestLimits
from supervisor.config import MigrationSection
from supervisor.router.attempts import Upstreams
from supervisor.router.continuation import PATHS, Tracked, error_event, parse_request
from supervisor.router.limits import Refusal, check_request, read_body
from supervisor.router.migrating import Migrator, Publish, StreamAborted
from supervisor.router.replies import Receive, Reply, Send, cut, error_body, json_reply, send_whole, target_of
from supervisor.router.routing import PrimaryLost, Upstream
from supervisor.router.upstream import NOT_RELAYED, Headers, UpstreamError, UpstreamTimeout
from supervisor.router.upstream import Response as UpstreamResponse

log = logging.getLogger("understudy.router")

METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH"})  # no HEAD: the FastAPI route had none
# The engines' endpoints for the router itself (engines/frontend/continuation_batch.py): a batch would let one
# client request carry thousands of streams past the router's limits; no client reaches them.
ROUTER_ONLY = frozenset({"/v1/continuations", "/v1/continuations/abort"})
DEFAULT_LIMITS = RequestLimits()


class Proxy:
    """``/v1/*`` as a bare ASGI callable."""

    def __init__(self, upstreams: Upstreams, migration: MigrationSection, publish: Publish | None,
                 limits: RequestLimits | None, body_timeout_s: float,
                 key_chain: tuple[bytes, int] | None = None, external: bool = False) -> None:
        self.u = upstreams
        self.migrator = Migrator(upstreams, migration, publish, (limits or DEFAULT_LIMITS).max_body_bytes, key_chain,
                                 external)
        self.limits, self.body_timeout_s = limits, body_timeout_s

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        table = self.u.table
        table.requests_in_progress += 1
        try:
            await self._handle(scope, receive, send)
        finally:
            table.requests_in_progress -= 1

    async def _handle(self, scope: dict, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        if scope["path"] in ROUTER_ONLY:
            self.u.count_status(404)
            await send_whole(send, json_reply(404, error_body(f"{scope['path']} is the router's own endpoint on its "
                                                              f"engines, not served here", "invalid_request_error",
                                                              404)))
            return
        if scope["method"] not in METHODS:  # as FastAPI answered for the old route
            await send_whole(send, json_reply(405, error_body(f"method {scope['method']} is not allowed",
                                                              "invalid_request_error", 405),
                                              [(b"allow", ", ".join(sorted(METHODS)).encode())]))
            return
        try:  # bounded: size, time, prompts and n (supervisor/router/limits.py)
            limits = self.limits
            body = await read_body(scope, receive, (limits or DEFAULT_LIMITS).max_body_bytes, self.body_timeout_s)
            req = parse_request(scope["path"], body) if body is not None else None
            if isinstance(req, dict) and "continuation" in req and scope["path"] in PATHS:
                raise Refusal(400, error_body("`continuation` is the router's own field (a stream it continues on "
                                              "a new primary, which then waits behind no new request); a client "
                                              "may not send it", "invalid_request_error", 400))
            if limits is not None:
                check_request(scope["path"], req, limits)
        except Refusal as e:
            self.u.count_status(e.status)
            await send_whole(send, json_reply(e.status, e.body, [(b"connection", b"close")] if e.status != 400 else []))
            return
        if body is None:  # our client left before sending its request whole
            return
        cfg = self.migrator.cfg
        tracked = Tracked.parse(scope["path"], req, cfg.max_replay_tokens, arrived, self.migrator.key_chain,
                                self.migrator.external) \
            if cfg.enabled and scope["method"] == "POST" else None
        target, headers = target_of(scope)
        if tracked is not None:  # when our client goes away, stop (dropping the upstream connection)
            try:
                await unless_client_leaves(self.migrator.serve(tracked, target, headers, send), receive)
            except StreamAborted:  # the error event went out: cut the connection, so it cannot pass for an end
                if not cut(scope):
                    raise
            return
        reply = await self._forward(scope["method"], target, headers, body)
        self.u.count_status(reply.status)
        if reply.stream is None:
            await send_whole(send, reply)
        else:
            try:
                await self._relay(reply, reply.stream, receive, send)
            except UpstreamError:  # _pump said so in the stream: cut the connection (see above)
                if not cut(scope):
                    raise

    def _why_untracked(self) -> str:
        """Why a request was passed through, not tracked for continuation."""
        if not self.migrator.cfg.enabled:
            return "continuation is off: router.migration.enabled is false"
        return "only completions and chat completions with n=1 and one prompt can"

    async def _forward(self, method: str, target: bytes, headers: Headers, body: bytes) -> Reply:
        """Send the request to the primary (waiting for one, trying again on a new one) and get its answer."""
        attempts = self.u.attempts()
        while (up := await attempts.primary()) is not None:
            try:  # nothing is sent to our client before this returns: any failure can be tried again
                resp, content = await attempts.call(up, self._call(up, method, target, headers, body))
            except UpstreamTimeout:  # the engine is slow, not gone: sending it again would not help
                return json_reply(504, {"error": {"message": self.u.timed_out(up.name), "type": "timeout",
                                                  "code": 504}})
            except (UpstreamError, PrimaryLost) as e:
                attempts.failed(up, e)
                continue
            if attempts.may_retry(resp.status):
                resp.close()
                attempts.failed(up, f"HTTP {resp.status}")
                continue
            out = [(k, v) for k, v in resp.headers if k not in NOT_RELAYED]
            out += [(b"x-understudy-engine", up.name.encode()), (b"x-understudy-epoch", str(up.epoch).encode())]
            if content is None:
                return Reply(resp.status, out, stream=resp, epoch=up.epoch)
            self.u.served(up.epoch, resp.status)
            return Reply(resp.status, out, content)
        return json_reply(503, {"error": {"message": attempts.unavailable(), "type": "unavailable", "code": 503}},
                          [(b"retry-after", str(self.u.retry_after_s).encode())])

    async def _call(self, up: Upstream, method: str, target: bytes, headers: Headers,
                    body: bytes) -> tuple[UpstreamResponse, bytes | None]:
        """One attempt: the response and its whole body, or (an event stream) its head only."""
        resp = await self.u.client.request(method, up.url, target, headers, body)
        if resp.is_event_stream:
            return resp, None
        return resp, await resp.read()  # whole body first: a failure before we answer can still be retried

    async def _relay(self, reply: Reply, resp: UpstreamResponse, receive: Receive, send: Send) -> None:
        """Pass an event stream through chunk by chunk; when our client goes away, stop and drop the
        upstream connection (the engine then stops generating)."""
        try:
            await unless_client_leaves(self._pump(reply, resp, send), receive)
        finally:
            resp.close()

    async def _pump(self, reply: Reply, resp: UpstreamResponse, send: Send) -> None:
        await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
        began_at = None
        try:
            async for chunk in resp.stream():
                began_at = began_at or time.monotonic()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.u.served(reply.epoch, reply.status, began_at)  # a stream succeeds when it ends whole
        except UpstreamError as e:  # bytes already sent, and this request cannot be continued: say so
            log.warning("upstream stream broke after the first byte: %s", type(e).__name__)
            self.u.metrics.migrations.labels(result="unsupported").inc()
            await send({"type": "http.response.body", "more_body": True, "body": error_event(
                f"the engine was lost mid-response ({type(e).__name__}) and this request cannot be continued "
                f"({self._why_untracked()})", "migration_failed", 502)})
            raise
        finally:
            resp.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
