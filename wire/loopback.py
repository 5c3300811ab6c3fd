"""Serving on loopback, shared by engines and the supervisor: a free port, and a uvicorn server
that leaves signal handling to its owner (the engine drains; the supervisor loop decides)."""
from __future__ import annotations

import contextlib
import socket
from typing import Iterator

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class QuietServer(uvicorn.Server):
    """uvicorn.Server without its own SIGTERM/SIGINT handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
