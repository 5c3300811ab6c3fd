"""Data plane: OpenAI endpoints proxied to the primary, streams passed through; a request whose
upstream failed before the first response byte is retried on the (new) primary; requests wait for
a primary during a failover, then get 503 + Retry-After. Completions and chat completions (n=1) are
continued on the new primary when theirs is lost mid-request (supervisor/migrating.py); only their
bodies are parsed.

``/v1/*`` is served by a bare ASGI callable and the lean client of supervisor/upstream.py: every
request pays for this path, so no framework routing or request/response objects on it. The probes
(``/healthz``, ``/readyz``) and the lifespan are bare ASGI too."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from engines.interrupt import unless_client_leaves
from engines.limits import RequestLimits
from supervisor.config import MigrationSection
from supervisor.continuation import Tracked, error_event, parse_request
from supervisor.limits import Refusal, check_request, read_body
from supervisor.metrics import Metrics
from supervisor.migrating import Migrator, Publish
from supervisor.routing import PrimaryLost, RoutingTable, Upstream
from supervisor.upstream import HOP_BY_HOP, NOT_RELAYED, Client, Headers, UpstreamError, UpstreamTimeout
from supervisor.upstream import Response as UpstreamResponse

log = logging.getLogger("understudy.router")

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[dict, Receive, Send], Awaitable[None]]

METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH"})  # no HEAD: the FastAPI route had none
RETRY_STATUSES = {502, 503}  # engine refusing (draining) or not there: another primary may serve
SAME_PRIMARY_RETRY_S = 0.25
DEFAULT_LIMITS = RequestLimits()


def build_router(table: RoutingTable, metrics: Metrics, *, hold_timeout_s: float, retry_after_s: int,
                 upstream_timeout_s: float, max_connections: int = 1024, migration: MigrationSection | None = None,
                 publish: Publish | None = None, limits: RequestLimits | None = None,
                 body_timeout_s: float = 30.0) -> ASGIApp:
    """The data-plane ASGI app: ``/v1/*`` to the proxy, everything else to the probes (and lifespan).
    ``publish`` gets the migration events; ``limits`` bound prompts and n (None: body size only)."""
    client = Client(timeout_s=upstream_timeout_s, connect_timeout_s=5.0, max_connections=max_connections)
    proxy = Proxy(table, metrics, client, hold_timeout_s=hold_timeout_s, retry_after_s=retry_after_s,
                  upstream_timeout_s=upstream_timeout_s, migration=migration, publish=publish)
    proxy.limits, proxy.body_timeout_s = limits, body_timeout_s
    probes = _probes_app(table, client)

    async def app(scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            await proxy(scope, receive, send)
        else:
            await probes(scope, receive, send)
    return app


def _probes_app(table: RoutingTable, client: Client) -> ASGIApp:
    """/healthz, /readyz, every other path's 404/405 in the OpenAI error shape, and the lifespan that
    closes the upstream connections. Bare ASGI: a restarted supervisor serves without first
    importing a web framework (fastapi alone takes 0.3 s to import on the GPU host)."""
    async def app(scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return  # (websocket: uvicorn closes it)
        method, path = scope["method"], scope["path"]
        if path not in ("/healthz", "/readyz"):
            reply = _json_reply(404, _error_body(f"Not Found ({method} {path})", "invalid_request_error", 404))
        elif method != "GET":
            reply = _json_reply(405, _error_body(f"Method Not Allowed ({method} {path})", "invalid_request_error",
                                                 405), [(b"allow", b"GET")])
        elif path == "/healthz":
            reply = _json_reply(200, {"ok": True})
        else:
            reply = _readyz(table)
        await _send_whole(send, reply)
    return app


def _readyz(table: RoutingTable) -> Reply:
    """200 with the primary, or 503 saying why the node cannot serve."""
    if table.stopping:
        return _json_reply(503, {"ready": False, "reason": "supervisor is stopping"})
    if table.drained:
        return _json_reply(503, {"ready": False, "reason": "node is drained"})
    if table.primary is None:
        return _json_reply(503, {"ready": False, "reason": table.not_ready_reason})
    return _json_reply(200, {"ready": True, "primary": table.primary.name, "epoch": table.primary.epoch})


class Reply:
    """What the proxy answers: a whole body, or an upstream event stream to pass through."""
    __slots__ = ("status", "headers", "body", "stream", "epoch")

    def __init__(self, status: int, headers: Headers, body: bytes = b"",
                 stream: UpstreamResponse | None = None, epoch: int = 0) -> None:
        self.status, self.headers, self.body, self.stream, self.epoch = status, headers, body, stream, epoch


class Proxy:
    """``/v1/*`` as a bare ASGI callable."""

    def __init__(self, table: RoutingTable, metrics: Metrics, client: Client, *, hold_timeout_s: float,
                 retry_after_s: int, upstream_timeout_s: float, migration: MigrationSection | None = None,
                 publish: Publish | None = None) -> None:
        self.table, self.metrics, self.client = table, metrics, client
        self.hold_timeout_s, self.retry_after_s = hold_timeout_s, retry_after_s
        self.upstream_timeout_s = upstream_timeout_s
        self._by_code: dict[int, Any] = {}  # status -> router_requests child (labels() is not free)
        self.migrator = Migrator(self, migration or MigrationSection(), publish)

    def count_status(self, status: int) -> None:
        counter = self._by_code.get(status)
        if counter is None:
            counter = self._by_code[status] = self.metrics.router_requests.labels(code=str(status))
        counter.inc()

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        if scope["method"] not in METHODS:  # as FastAPI answered for the old route
            await _send_whole(send, _json_reply(405, _error_body(f"method {scope['method']} is not allowed",
                                                                 "invalid_request_error", 405),
                                                [(b"allow", ", ".join(sorted(METHODS)).encode())]))
            return
        try:  # bounded: size, time, prompts and n (supervisor/limits.py)
            limits = self.limits
            body = await read_body(scope, receive, (limits or DEFAULT_LIMITS).max_body_bytes, self.body_timeout_s)
            req = parse_request(scope["path"], body) if body is not None else None
            if limits is not None:
                check_request(scope["path"], req, limits)
        except Refusal as e:
            self.metrics.router_requests.labels(code=str(e.status)).inc()
            await _send_whole(send, _json_reply(e.status, e.body, [(b"connection", b"close")] if e.status != 400 else []))
            return
        if body is None:  # our client left before sending its request whole
            return
        cfg = self.migrator.cfg
        tracked = Tracked.parse(scope["path"], req, cfg.max_replay_tokens, arrived) \
            if cfg.enabled and scope["method"] == "POST" else None
        if tracked is not None:
            await self._tracked(scope, tracked, receive, send)
            return
        reply = await self._forward(scope, body)
        self.count_status(reply.status)
        if reply.stream is None:
            await _send_whole(send, reply)
        else:
            await self._relay(reply, reply.stream, receive, send)

    async def _tracked(self, scope: dict, tracked: Tracked, receive: Receive, send: Send) -> None:
        """A continuable request; when our client goes away, stop (dropping the upstream connection)."""
        target, headers = _target(scope)
        # its StreamAborted is re-raised: uvicorn aborts the connection, so the cut cannot pass for an end
        await unless_client_leaves(self.migrator.serve(tracked, target, headers, send), receive)

    async def _forward(self, scope: dict, body: bytes) -> Reply:
        """Send the request to the primary (waiting for one, retrying on a new one) and get its answer."""
        method = scope["method"]
        target, headers = _target(scope)
        start = time.monotonic()
        deadline = start + self.hold_timeout_s
        failed_epoch: int | None = None
        last_error = "no primary"
        held = False
        table, metrics = self.table, self.metrics
        while True:
            up = table.primary
            if up is None or (failed_epoch is not None and up.epoch == failed_epoch):
                held = True
                up = None if table.stopping else await table.wait_primary(
                    deadline, not_epoch=failed_epoch, settle_s=SAME_PRIMARY_RETRY_S if failed_epoch is not None else None)
                if up is None:
                    metrics.router_hold.observe(time.monotonic() - start)
                    reason = "the supervisor is stopping" if table.stopping else (
                        last_error if failed_epoch is not None else table.not_ready_reason)
                    return self._unavailable(f"no engine available within {self.hold_timeout_s:g}s: {reason}")
            if failed_epoch is not None:
                metrics.router_retries.inc()
            try:  # nothing is sent to our client before this returns: any failure can be retried
                resp, content = await table.unless_lost(up.epoch, self._call(up, method, target, headers, body))
            except UpstreamTimeout:  # the engine is slow, not gone: sending it again would not help
                return self._timeout(up.name)
            except (UpstreamError, PrimaryLost) as e:
                failed_epoch, last_error = up.epoch, f"{up.name}: {type(e).__name__} {e}".strip()
                continue
            if resp.status in RETRY_STATUSES and time.monotonic() < deadline:
                resp.close()
                failed_epoch, last_error = up.epoch, f"{up.name}: HTTP {resp.status}"
                continue
            if held:
                metrics.router_hold.observe(time.monotonic() - start)
            out = [(k, v) for k, v in resp.headers if k not in NOT_RELAYED]
            out += [(b"x-understudy-engine", up.name.encode()), (b"x-understudy-epoch", str(up.epoch).encode())]
            if content is None:
                return Reply(resp.status, out, stream=resp, epoch=up.epoch)
            self.served(up.epoch, resp.status)
            return Reply(resp.status, out, content)

    async def _call(self, up: Upstream, method: str, target: bytes, headers: Headers,
                    body: bytes) -> tuple[UpstreamResponse, bytes | None]:
        """One attempt: the response and its whole body, or (an event stream) its head only."""
        resp = await self.client.request(method, up.url, target, headers, body)
        if resp.is_event_stream:
            return resp, None
        return resp, await resp.read()  # whole body first: a failure before we answer can still be retried

    def served(self, epoch: int, status: int, began_at: float | None = None) -> None:
        """A response succeeded: the first success of a new primary ends its failover clock at the
        moment the response began going to the client (a stream's first chunk: as clients time it)."""
        if status < 500 and (secs := self.table.first_success(epoch, began_at)) is not None:
            self.metrics.failover_seconds.observe(secs)  # failure detected -> new primary serving

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
            self.served(reply.epoch, reply.status, began_at)  # a stream succeeds when it ends whole
        except UpstreamError as e:  # bytes already sent, and this request cannot be continued: say so
            log.warning("upstream stream broke after the first byte: %s", type(e).__name__)
            self.metrics.migrations.labels(result="unsupported").inc()
            await send({"type": "http.response.body", "more_body": True, "body": error_event(
                f"the engine was lost mid-response ({type(e).__name__}) and this request cannot be continued "
                f"(only completions and chat completions with n=1 can)", "migration_failed", 502)})
            raise
        finally:
            resp.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _timeout(self, engine: str) -> Reply:
        message = f"engine {engine} did not answer within router.upstream_timeout_s={self.upstream_timeout_s:g}s"
        return _json_reply(504, {"error": {"message": message, "type": "timeout", "code": 504}})

    def _unavailable(self, message: str) -> Reply:
        return _json_reply(503, {"error": {"message": message, "type": "unavailable", "code": 503}},
                           [(b"retry-after", str(self.retry_after_s).encode())])


def _target(scope: dict) -> tuple[bytes, Headers]:
    """The request target (path?query) and the headers to pass on."""
    target = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
    if query := scope.get("query_string"):
        target += b"?" + query
    return target, [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP]


def _error_body(message: str, type_: str, code: int) -> dict:
    """OpenAI's error shape, as the engines answer."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _json_reply(status: int, content: dict, headers: Headers | None = None) -> Reply:
    body = json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    return Reply(status, [(b"content-type", b"application/json"), *(headers or [])], body)


async def _send_whole(send: Send, reply: Reply) -> None:
    """A response with its body known: Content-Length framed (none where HTTP allows no body)."""
    headers = reply.headers
    if not (reply.status < 200 or reply.status in (204, 304)):
        headers = [*headers, (b"content-length", str(len(reply.body)).encode())]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})
