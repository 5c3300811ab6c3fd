"""uvicorn servers inside our loop: sockets bound by us first (clear 'port in use' before any child
starts; port 0 works), no uvicorn signal handling (the supervisor owns signals), and the guarded
protocol of wire/guarded_http.py with a connection cap that fits the open-files limit (raised to
the hard limit at boot)."""
from __future__ import annotations

import errno
import logging
import resource
import socket

from wire.guarded_http import Gate, ListenerLimits, SpareFdListener, guarded_config
from wire.loopback import QuietServer
from supervisor.config import UnderstudyConfig

log = logging.getLogger("understudy")

FD_RESERVE = 128  # descriptors kept for everything but client connections (children, zmq, files)


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
                name: str = "listener", gate: Gate | None = None) -> QuietServer:
    """A server for ``app`` on the pre-bound ``sock``, with a connection cap (shared fairly between
    clients where ``limits.peer_share`` says), header/idle timeouts, and ``gate`` checking each
    request's credentials on its head (the admin API)."""
    limits = limits or ListenerLimits(keepalive_timeout_s=30)
    cfg = guarded_config(app, limits, name, gate, log_level=log_level, access_log=False, lifespan="on",
                         timeout_graceful_shutdown=5)
    return QuietServer(cfg)


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
                            keepalive_timeout_s=lim.keepalive_timeout_s, peer_share=lim.peer_connection_share)
    admin = ListenerLimits(max_connections=lim.admin_max_connections, header_timeout_s=lim.header_timeout_s,
                           keepalive_timeout_s=lim.keepalive_timeout_s, peer_share=lim.peer_connection_share)
    return router, admin
