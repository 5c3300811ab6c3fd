"""A guarded listener (wire/guarded_http.py) serving an ASGI app on a port of its own, in a thread:
what the listener tests start (real sockets, our own listener code, no network)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

from wire.guarded_http import Gate, ListenerLimits, guarded_config
from wire.loopback import QuietServer


def serve_guarded(app, limits: ListenerLimits, gate: Gate | None = None, backlog: int = 64) -> Iterator[tuple[int, object]]:  # noqa: ANN001, E501
    """Yields (port, the listener's ConnectionStats) while it serves; stops it after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    cfg = guarded_config(app, limits, "test", gate, log_level="warning", lifespan="off")
    server = QuietServer(cfg)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1], cfg.connection_stats  # type: ignore[attr-defined]
    server.should_exit = True
    thread.join(10)
