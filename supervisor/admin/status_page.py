"""The status page on the admin port: ``GET /ui`` (one HTML file, plain JS, no build step) and
``GET /events`` (the event stream it reads, bearer-protected like every admin route).

``/ui`` itself is served without the token: it is a static file holding no data, and a browser
cannot send a bearer header when it navigates. The page asks for the token, keeps it in the tab
(``sessionStorage``) and sends it as ``Authorization: Bearer`` on every call, the event stream
included: the page reads ``/events`` with ``fetch`` instead of ``EventSource`` (which cannot set
headers), so the token never sits in a URL, a server log, the history or a Referer. The page's
Content-Security-Policy admits only its own inline script and style (by hash), and only
same-origin requests; no frame may embed it (the action buttons cannot be clickjacked).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import HTMLResponse, Response

from supervisor.admin.event_stream import EventFanout, TooManyClients

PAGE = Path(__file__).with_name("ui") / "status.html"


class StatusPage:
    """Owns the event fan-out; ``lifespan`` starts and stops it, ``register`` adds the two routes."""

    def __init__(self, events_endpoint: Callable[[], str], stopping: Callable[[], bool] = lambda: False,
                 **fanout_options: Any) -> None:
        self.fanout = EventFanout(events_endpoint, stopping=stopping, **fanout_options)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        await self.fanout.start()
        try:
            yield
        finally:
            await self.fanout.close()

    def register(self, app: FastAPI) -> None:
        # A plain Starlette route: FastAPI's app-wide bearer dependency does not apply to it.
        app.add_route("/ui", self.page, methods=["GET"], include_in_schema=False)

        @app.get("/events", include_in_schema=False)
        async def events(request: Request) -> Response:
            try:
                return self.fanout.stream(request.headers.get("last-event-id"))
            except TooManyClients as e:
                return JSONResponse({"error": f"too many event streams: {e}"}, status_code=503,
                                    headers={"Retry-After": "5"})

    async def page(self, _: Request) -> Response:
        html, csp = _page()
        return HTMLResponse(html, headers={"content-security-policy": csp, "x-frame-options": "DENY",
                                           "referrer-policy": "no-referrer", "cache-control": "no-store",
                                           "x-content-type-options": "nosniff"})


@lru_cache(maxsize=1)
def _page() -> tuple[str, str]:
    """The page's text, each ``<script src="NAME.js">`` of ui/ inlined, and a CSP naming the hashes of
    its inline scripts and style (so the page is one response and no script is loaded by URL)."""
    html = re.sub(r'<script src="([\w-]+\.js)"></script>',
                  lambda m: f"<script>{(PAGE.parent / m.group(1)).read_text(encoding='utf-8')}</script>",
                  PAGE.read_text(encoding="utf-8"))

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, csp
