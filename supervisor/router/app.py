"""The data plane's ASGI app: ``/v1/*`` to the proxy (supervisor/router/proxy.py), and the probes
(``/healthz``, ``/readyz``) and the lifespan as bare ASGI: a restarted supervisor serves without
first importing a web framework (fastapi alone takes 0.3 s to import on the GPU host)."""
from __future__ import annotations

from wire.limits import RequestLimits
from supervisor.config import MigrationSection
from supervisor.metrics import Metrics
from supervisor.router.attempts import Upstreams
from supervisor.router.migrating import Publish
from supervisor.router.proxy import Proxy
from supervisor.router.replies import ASGIApp, Receive, Reply, Send, error_body, json_reply, send_whole
from supervisor.router.routing import RoutingTable
from supervisor.router.upstream import Client, Headers


def build_router(table: RoutingTable, metrics: Metrics, *, hold_timeout_s: float, retry_after_s: int,
                 upstream_timeout_s: float, max_connections: int = 1024, migration: MigrationSection | None = None,
                 publish: Publish | None = None, limits: RequestLimits | None = None,
                 body_timeout_s: float = 30.0, key_chain: tuple[bytes, int] | None = None,
                 local_headers: Headers = (), external: bool = False) -> ASGIApp:
    """The data-plane ASGI app: ``/v1/*`` to the proxy, everything else to the probes (and lifespan).
    ``publish`` gets the migration events; ``limits`` bound prompts and n (None: body size only);
    ``key_chain``: the engines' block keys' (key root, block size), for a failover batch's block keys;
    ``external``: the engines are external (supervisor/router/abilities.py)."""
    client = Client(timeout_s=upstream_timeout_s, connect_timeout_s=5.0, max_connections=max_connections,
                    local_headers=local_headers)
    upstreams = Upstreams(table, metrics, client, hold_timeout_s=hold_timeout_s, retry_after_s=retry_after_s,
                          upstream_timeout_s=upstream_timeout_s)
    proxy = Proxy(upstreams, migration or MigrationSection(), publish, limits, body_timeout_s, key_chain, external)
    probes = _probes_app(table, client)

    async def app(scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            await proxy(scope, receive, send)
        else:
            await probes(scope, receive, send)
    return app


def _probes_app(table: RoutingTable, client: Client) -> ASGIApp:
    """/healthz, /readyz, every other path's 404/405 in the OpenAI error shape, and the lifespan that
    closes the upstream connections."""
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
            reply = json_reply(404, error_body(f"Not Found ({method} {path})", "invalid_request_error", 404))
        elif method != "GET":
            reply = json_reply(405, error_body(f"Method Not Allowed ({method} {path})", "invalid_request_error",
                                               405), [(b"allow", b"GET")])
        elif path == "/healthz":
            reply = json_reply(200, {"ok": True})
        else:
            reply = _readyz(table)
        await send_whole(send, reply)
    return app


def _readyz(table: RoutingTable) -> Reply:
    """200 with the primary, or 503 saying why the node cannot serve."""
    if table.stopping:
        return json_reply(503, {"ready": False, "reason": "supervisor is stopping"})
    if table.drained:
        return json_reply(503, {"ready": False, "reason": "node is drained"})
    if table.primary is None:
        return json_reply(503, {"ready": False, "reason": table.not_ready_reason})
    return json_reply(200, {"ready": True, "primary": table.primary.name, "epoch": table.primary.epoch})
