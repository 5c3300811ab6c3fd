"""Async client of the supervisor's admin API (bearer token): status, metrics, promote, rollout."""
from __future__ import annotations

from typing import Any

import httpx


class AdminError(RuntimeError):
    """The admin API could not be used; the message is one line saying why."""


class AdminClient:
    """Calls `admin_url` with the token; every call has a timeout."""

    def __init__(self, admin_url: str, token: str, timeout_s: float = 5.0) -> None:
        self.admin_url = admin_url
        self._http = httpx.AsyncClient(
            base_url=admin_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s),
            trust_env=False,  # loopback only: never through a proxy from the environment
        )

    async def close(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _call(self, method: str, path: str, timeout_s: float | None = None) -> httpx.Response:
        url = f"{self.admin_url}{path}"
        kwargs: dict[str, Any] = {}
        if timeout_s is not None:
            kwargs["timeout"] = httpx.Timeout(timeout_s)
        try:
            resp = await self._http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise AdminError(f"admin API timed out: {method} {url}") from None
        except httpx.HTTPError as exc:
            raise AdminError(f"admin API unreachable: {method} {url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code in (401, 403):
            raise AdminError(f"admin token rejected ({resp.status_code}) by {url}")
        return resp

    async def status(self) -> dict[str, Any]:
        """GET /status as JSON."""
        resp = await self._call("GET", "/status")
        if resp.status_code != 200:
            raise AdminError(f"GET {self.admin_url}/status: expected 200, got {resp.status_code}")
        try:
            body = resp.json()
        except ValueError:
            raise AdminError(f"GET {self.admin_url}/status: body is not JSON") from None
        if not isinstance(body, dict):
            raise AdminError(f"GET {self.admin_url}/status: expected a JSON object")
        return body

    async def metrics(self) -> str:
        """GET /metrics as Prometheus text."""
        resp = await self._call("GET", "/metrics")
        if resp.status_code != 200:
            raise AdminError(f"GET {self.admin_url}/metrics: expected 200, got {resp.status_code}")
        return resp.text

    async def post(self, path: str, timeout_s: float) -> tuple[int, str]:
        """POST an admin action; (status code, first 300 chars of the body)."""
        resp = await self._call("POST", path, timeout_s=timeout_s)
        return resp.status_code, resp.text[:300]
