"""Data plane: OpenAI endpoints proxied to the primary, streams passed through; a request whose
upstream failed before the first response byte is retried on the (new) primary; requests wait for
a primary during a failover, then get 503 + Retry-After. Never parses request bodies."""
from __future__ import annotations

import contextlib
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from supervisor.metrics import Metrics
from supervisor.routing import PrimaryLost, RoutingTable

log = logging.getLogger("understudy.router")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}
RETRY_STATUSES = {502, 503}  # engine refusing (draining) or not there: another primary may serve
SAME_PRIMARY_RETRY_S = 0.25


def build_router(table: RoutingTable, metrics: Metrics, *, hold_timeout_s: float, retry_after_s: int,
                 upstream_timeout_s: float, max_connections: int = 1024) -> FastAPI:
    """The data-plane app."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    client = httpx.AsyncClient(timeout=httpx.Timeout(upstream_timeout_s, connect=5.0), limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="understudy data plane", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.client = client

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> Response:
        if table.stopping:
            return JSONResponse({"ready": False, "reason": "supervisor is stopping"}, status_code=503)
        if table.drained:
            return JSONResponse({"ready": False, "reason": "node is drained"}, status_code=503)
        if table.primary is None:
            return JSONResponse({"ready": False, "reason": table.not_ready_reason}, status_code=503)
        return JSONResponse({"ready": True, "primary": table.primary.name, "epoch": table.primary.epoch})

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(path: str, request: Request) -> Response:
        resp = await _forward(request, "/v1/" + path)
        metrics.router_requests.labels(code=str(resp.status_code)).inc()
        return resp

    async def _forward(request: Request, path: str) -> Response:
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        query = request.url.query
        start = time.monotonic()
        deadline = start + hold_timeout_s
        failed_epoch: int | None = None
        last_error = "no primary"
        held = False
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
                    return _unavailable(f"no engine available within {hold_timeout_s:g}s: {reason}")
            if failed_epoch is not None:
                metrics.router_retries.inc()
            url = up.url + path + (f"?{query}" if query else "")
            req = client.build_request(request.method, url, headers=headers, content=body)
            try:
                upstream = await table.unless_lost(up.epoch, client.send(req, stream=True))
            except httpx.TimeoutException:  # the engine is slow, not gone: sending it again would not help
                return _timeout(up.name)
            except (httpx.HTTPError, PrimaryLost) as e:  # nothing was sent to our client yet: retry
                failed_epoch, last_error = up.epoch, f"{up.name}: {type(e).__name__} {e}".strip()
                continue
            if upstream.status_code in RETRY_STATUSES and time.monotonic() < deadline:
                await upstream.aclose()
                failed_epoch, last_error = up.epoch, f"{up.name}: HTTP {upstream.status_code}"
                continue
            if held:
                metrics.router_hold.observe(time.monotonic() - start)
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            out_headers["x-understudy-engine"] = up.name
            out_headers["x-understudy-epoch"] = str(up.epoch)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(_relay(upstream, up.epoch), status_code=upstream.status_code,
                                         headers=out_headers)
            try:  # whole body first: a failure before we answer can still be retried
                content = await table.unless_lost(up.epoch, _read_all(upstream))
            except httpx.TimeoutException:
                return _timeout(up.name)
            except (httpx.HTTPError, PrimaryLost) as e:
                failed_epoch, last_error = up.epoch, f"{up.name}: {type(e).__name__} while reading"
                continue
            finally:
                await upstream.aclose()
            served(up.epoch, upstream.status_code)
            return Response(content, status_code=upstream.status_code, headers=out_headers)

    def served(epoch: int, status: int) -> None:
        """A response is on its way: the first success of a new primary ends its failover clock."""
        if status < 500 and (secs := table.first_success(epoch)) is not None:
            metrics.failover_seconds.observe(secs)  # failure detected -> new primary serving

    async def _read_all(upstream: httpx.Response) -> bytes:
        return b"".join([c async for c in upstream.aiter_raw()])

    def _timeout(engine: str) -> JSONResponse:
        message = f"engine {engine} did not answer within router.upstream_timeout_s={upstream_timeout_s:g}s"
        return JSONResponse({"error": {"message": message, "type": "timeout", "code": 504}}, status_code=504)

    def _unavailable(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "unavailable", "code": 503}},
                            status_code=503, headers={"Retry-After": str(retry_after_s)})

    async def _relay(upstream: httpx.Response, epoch: int):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
            served(epoch, upstream.status_code)  # a stream succeeds when it ends whole
        except httpx.HTTPError as e:  # bytes already sent: we can only end the stream
            log.warning("upstream stream broke after the first byte: %s", type(e).__name__)
        finally:
            await upstream.aclose()

    return app
