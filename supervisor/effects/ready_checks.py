"""An external daemon's readiness check (engines.external.daemon_ready, parsed by supervisor/ready_spec.py),
carried out: a Unix socket or a TCP port that accepts a connection, a URL that answers 200, or a line of
the daemon's log. Each returns None when it passed, else what it found."""
from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

from supervisor.ready_spec import ReadySpec, parse_ready

CONNECT_TIMEOUT_S = 2.0
LOG_READ_MAX = 4 << 20  # the last 4 MiB of a log are searched (a daemon says it is ready near its end)


async def not_ready(spec: str, log: Path) -> str | None:
    """Why the check ``spec`` does not pass now (None: it passes); ``log``: the daemon's log of this start."""
    r = parse_ready(spec)
    check = {"log": lambda: _log_problem(r, log), "http": lambda: _http_problem(r)}.get(r.kind,
                                                                                   lambda: _connect_problem(r))
    return await asyncio.to_thread(check)


def _http_problem(r: ReadySpec) -> str | None:
    """A GET that answers 200 (urllib: the daemon is not one of our engines, it gets none of their headers)."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(r.target, timeout=CONNECT_TIMEOUT_S) as resp:  # noqa: S310 (the operator's URL)
            return None if resp.status == 200 else f"{r} answered HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{r} answered HTTP {e.code}"
    except (OSError, ValueError) as e:
        return f"{r}: {getattr(e, 'reason', None) or e}"


def _connect_problem(r: ReadySpec) -> str | None:
    """A connection accepted (and closed at once): a stale socket file left by a killed daemon refuses one."""
    if r.kind == "unix":
        family, address = socket.AF_UNIX, r.target
    else:
        host, _, port = r.target.rpartition(":")
        family, address = socket.AF_INET6 if ":" in host else socket.AF_INET, (host.strip("[]"), int(port))
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(CONNECT_TIMEOUT_S)
            s.connect(address)
        return None
    except OSError as e:
        return f"{r}: {e.strerror or e}"


def _log_problem(r: ReadySpec, log: Path) -> str | None:
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_READ_MAX))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"{log}: {e.strerror or e}"
    pattern = re.compile(r.target)
    return None if any(pattern.search(line) for line in text.splitlines()) else f"no line of {log} matches {r.target!r}"
