"""Admin API (bearer token): status, metrics, promote, drain, undrain, restart, rollout; the status page."""
from __future__ import annotations

from typing import Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from supervisor.admin.gate import UNAUTHORIZED, bearer_ok
from supervisor.errors import AdminError
from supervisor.admin.status_page import StatusPage


class RestartBody(BaseModel):
    """An engine restart's JSON body, as an alternative to its `force` query parameter."""

    model_config = ConfigDict(extra="forbid", strict=True)
    force: bool = False


class AdminTarget(Protocol):
    """What the API asks of the node (supervisor/admin/requests.py)."""

    stopping: bool

    def status_dict(self) -> dict[str, Any]: ...
    def metrics_text(self) -> bytes: ...
    async def admin_promote(self) -> dict[str, Any]: ...
    async def admin_set_drained(self, drained: bool) -> dict[str, Any]: ...
    async def admin_restart(self, name: str, force: bool) -> dict[str, Any]: ...
    async def admin_rollout(self) -> dict[str, Any]: ...


def build_admin(target: AdminTarget, token: str) -> FastAPI:
    """The admin app; every route needs ``Authorization: Bearer <token>``."""
    expected = token.encode()

    async def auth(request: Request) -> None:  # (the listener checked it already: supervisor/admin/gate.py)
        if not bearer_ok(request.headers.get("authorization", "").encode(), expected):
            raise AdminError(401, UNAUTHORIZED)

    page = StatusPage(lambda: target.status_dict()["events"],  # /ui and /events (status_page.py)
                      stopping=lambda: target.stopping)
    app = FastAPI(title="understudy admin", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=page.lifespan, dependencies=[Depends(auth)])
    page.register(app)

    @app.exception_handler(AdminError)
    async def _admin_error(_: Request, exc: AdminError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "request"
        return JSONResponse({"error": f"{where}: {err.get('msg')} (got {err.get('input')!r})"}, status_code=400)

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
    async def restart(name: str, force: bool = False, body: RestartBody | None = None) -> dict:
        return await target.admin_restart(name, force or (body is not None and body.force))

    @app.post("/admin/rollout")
    async def rollout() -> dict:
        return await target.admin_rollout()

    return app
