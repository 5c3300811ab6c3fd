"""Request limits and connection hygiene on the supervisor's side.

- Router: the body is read within ``limits.body_timeout_s`` (408) and ``limits.max_body_bytes``
  (413, from Content-Length before a byte is read); a completion request's prompts and n are
  checked (400) before it goes anywhere, so external engines are bounded too. Bodies that are not
  JSON objects pass untouched: the engine names what is wrong with them.
- Listeners: router and admin get the guarded uvicorn protocol (engines/guarded_http.py), with a
  connection cap that fits the open-files limit (raised to the hard limit at boot).
- Engines get their request limits and listener limits in their EngineConfig.
"""
from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from typing import Any

from engines.guarded_http import ListenerLimits
from engines.limits import LimitError, RequestLimits, body_too_large, check_shape, drain
from supervisor.config import UnderstudyConfig

log = logging.getLogger("understudy")

Receive = Callable[[], Awaitable[dict]]
FD_RESERVE = 128  # descriptors kept for everything but client connections (children, zmq, files)
ENGINE_SLACK = 64  # an engine's listener: the router's pool plus probes and canaries


class Refusal(Exception):
    """A request refused before it is forwarded: ``status`` and an OpenAI-style ``body``."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def _refusal(e: LimitError) -> Refusal:
    return Refusal(e.status, e.body())


async def read_body(scope: dict, receive: Receive, max_bytes: int, timeout_s: float) -> bytes | None:
    """The whole request body, None if the client left first; Refusal when over a limit."""
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
                    await drain(receive)  # bounded; the answer then reaches the client
                    raise _refusal(body_too_large(int(value), max_bytes))
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    if message.get("more_body", False):
                        await drain(receive)
                    raise _refusal(body_too_large(size, max_bytes))
                parts.append(chunk)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
    except TimeoutError:
        raise Refusal(408, {"error": {"message": f"the request body did not arrive within {timeout_s:g}s "
                                                 f"(limits.body_timeout_s)", "type": "timeout", "param": None,
                                      "code": "body_timeout_s"}}) from None


def check_request(path: str, req: Any, limits: RequestLimits) -> None:
    """Prompts per request, n, prompts x n of a completion request, `req` its body as
    supervisor/continuation.py `parse_request` read it (Refusal when over; anything but a JSON
    object passes: the engine answers it with its own error)."""
    if not isinstance(req, dict):
        return
    n = req.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) else 1
    prompts = 1
    prompt = req.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompts = len(prompt)
    try:
        check_shape(limits, prompts, n, "messages" if path.endswith("chat/completions") else "prompt")
    except LimitError as e:
        raise _refusal(e) from None


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)
    return soft


def listener_limits(cfg: UnderstudyConfig, open_files: int) -> tuple[ListenerLimits, ListenerLimits]:
    """Router and admin listener limits; caps lowered so that client connections (each may hold an
    upstream connection too) cannot exhaust ``open_files``."""
    lim = cfg.limits
    budget = max(16, (open_files - FD_RESERVE - lim.admin_max_connections) // 2)
    router_cap = min(lim.max_client_connections, budget)
    if router_cap < lim.max_client_connections:
        log.warning("limits.max_client_connections=%d lowered to %d to fit the open-files limit %d "
                    "(raise it: LimitNOFILE= in the unit, ulimit -n)", lim.max_client_connections, router_cap,
                    open_files)
    router = ListenerLimits(max_connections=router_cap, header_timeout_s=lim.header_timeout_s,
                            keepalive_timeout_s=lim.keepalive_timeout_s)
    admin = ListenerLimits(max_connections=lim.admin_max_connections, header_timeout_s=lim.header_timeout_s,
                           keepalive_timeout_s=lim.keepalive_timeout_s)
    return router, admin


def engine_limits(cfg: UnderstudyConfig) -> dict:
    """The EngineConfig fields for limits: request limits, and a listener sized for the router's pool."""
    listener = ListenerLimits(max_connections=cfg.router.max_connections + ENGINE_SLACK,
                              header_timeout_s=cfg.limits.header_timeout_s)
    return {"limits": cfg.limits.request_limits(), "listener": listener}
