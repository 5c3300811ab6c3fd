"""Admin API (bearer token): status, metrics, promote, drain, undrain, restart, rollout; the status page."""
from __future__ import annotations

import hmac
from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from supervisor.status_page import StatusPage


class AdminError(Exception):
    """An admin request that cannot be done; ``status`` is the HTTP code (404, 409, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AdminTarget(Protocol):
    def status_dict(self) -> dict[str, Any]: ...
    def metrics_text(self) -> bytes: ...
    async def admin_promote(self) -> dict[str, Any]: ...
    async def admin_set_drained(self, drained: bool) -> dict[str, Any]: ...
    async def admin_restart(self, name: str, force: bool) -> dict[str, Any]: ...
    async def admin_rollout(self) -> dict[str, Any]: ...


def build_admin(target: AdminTarget, token: str) -> FastAPI:
    """The admin app; every route needs ``Authorization: Bearer <token>``."""
    expected = f"Bearer {token}".encode()

    async def auth(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            raise AdminError(401, "missing or wrong bearer token (see admin.token_file)")

    page = StatusPage(lambda: target.status_dict()["events"],  # /ui and /events (status_page.py)
                      stopping=lambda: bool(getattr(target, "stopping", False)))
    app = FastAPI(title="understudy admin", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=page.lifespan, dependencies=[Depends(auth)])
    page.register(app)

    @app.exception_handler(AdminError)
    async def _admin_error(_: Request, exc: AdminError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)

    @app.get("/status")
    async def status() -> dict:
        return target.status_dict()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(target.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/admin/promote")
    async def promote() -> dict:
        return await target.admin_promote()

    @app.post("/admin/drain")
    async def drain() -> dict:
        return await target.admin_set_drained(True)

    @app.post("/admin/undrain")
    async def undrain() -> dict:
        return await target.admin_set_drained(False)

    @app.post("/admin/engines/{name}/restart")
    async def restart(name: str, force: bool = False) -> dict:
        return await target.admin_restart(name, force)

    @app.post("/admin/rollout")
    async def rollout() -> dict:
        return await target.admin_rollout()

    return app
