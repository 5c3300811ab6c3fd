"""What the router's relay loop (supervisor/router/migrating.py `_Call._attempt`) reports besides the
bytes it relays, in one observer the loop calls at three points of each chunk: it came from the
engine (`came`), it was parsed (`fed`), it went to our client (`relayed`).

- a stall: no bytes from the engine for STALL_LOG_S after the first token, or our client taking
  that long to take a chunk (a WARNING each, wire/stream_timing.py);
- the first token's latency at the router (`understudy_router_first_token_seconds`, first attempts);
- a continuation's first new token (or its end): its timeline's `token` moment, and the migration
  counted as continued, with the stall the client saw."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from wire.stream_timing import STALL_LOG_S

if TYPE_CHECKING:
    from supervisor.router.continuation import Tracked
    from supervisor.router.routing import Upstream

log = logging.getLogger("understudy.router")


class WatchedCall(Protocol):
    """What the watch reads and records of the call it observes (supervisor/router/migrating.py `_Call`)."""

    req: Tracked
    m: Any  # its Migrator: the router's metrics and the migrations' counts
    migrations: int
    migrating_since: float | None
    replayed: int
    chunks_before: int
    timeline: dict[str, float]

    def _moment(self, name: str, now: float) -> None: ...


class RelayWatch:
    """One attempt's relay loop, observed."""

    def __init__(self, call: WatchedCall, up: Upstream) -> None:
        self.call, self.up = call, up
        self.waited_from = 0.0  # when the engine's last chunk was relayed (from the first token on; 0: not timed)
        self.had_tokens = 0

    def came(self) -> None:
        """A chunk came from the engine (before it is parsed)."""
        req = self.call.req
        if self.waited_from and (waited := time.monotonic() - self.waited_from) >= STALL_LOG_S:
            log.warning("request %s stalled on %s: no bytes from the engine for %.0f ms after %d chunks",
                        req.rid, self.up.name, waited * 1e3, req.chunks_sent)
        self.had_tokens = req.n_output

    def fed(self, now: float) -> None:
        """The chunk was parsed (`now`: then, as the relay times its bytes)."""
        call, req = self.call, self.call.req
        if not self.had_tokens and req.n_output and not call.migrations:
            call.m.u.metrics.router_first_token.observe(now - req.arrived)
        if call.migrating_since is not None and (req.progress or req.finish_reason or req.done):
            call._moment("token", now)
            call.m.count("continued", req, now - call.migrating_since, call.replayed, call.chunks_before,
                         call.timeline)
            call.migrating_since = None

    def relayed(self, now: float) -> None:
        """Our client has the chunk's bytes (or they were kept, for a non-streaming client)."""
        req = self.call.req
        relayed = time.monotonic()
        if relayed - now >= STALL_LOG_S:
            log.warning("request %s stalled: our client took %.0f ms to take a chunk", req.rid, (relayed - now) * 1e3)
        self.waited_from = relayed if req.n_output else 0.0
