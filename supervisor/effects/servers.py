"""uvicorn servers inside our loop: sockets bound by us first (clear 'port in use' before any child
starts; port 0 works), and no uvicorn signal handling (the supervisor owns signals)."""
from __future__ import annotations

import errno
import socket

from engines.guarded_http import ListenerLimits, SpareFdListener, guarded_config
from engines.loopback import QuietServer


class BindError(Exception):
    pass


def bind_tcp(host: str, port: int, what: str) -> socket.socket:
    """A listening socket, or BindError naming the address and who it is for."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when the proto says
    # TCP; with proto 0, Nagle + delayed ACK add ~40 ms to every response.
    s = SpareFdListener(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # EMFILE refuses, never spins or floods
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(2048)
    except OSError as e:
        s.close()
        why = "port is already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise BindError(f"{what}: cannot listen on {host}:{port}: {why}") from None
    s.set_inheritable(False)
    s.reserve_spare()
    return s


def make_server(app, sock: socket.socket, log_level: str, limits: ListenerLimits | None = None,
                name: str = "listener") -> QuietServer:
    """A server for ``app`` on the pre-bound ``sock``, with a connection cap and header/idle timeouts."""
    limits = limits or ListenerLimits(keepalive_timeout_s=30)
    cfg = guarded_config(app, limits, name, log_level=log_level, access_log=False, lifespan="on",
                         timeout_graceful_shutdown=5)
    return QuietServer(cfg)
