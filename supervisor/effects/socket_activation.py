"""systemd socket activation (sd_listen_fds(3)): listening sockets handed over as fds 3, 4, ...

With ``understudy.socket`` the kernel keeps the data port listening while the supervisor restarts:
connections made meanwhile wait in the backlog instead of being refused. Names come from
``LISTEN_FDNAMES`` (``FileDescriptorName=`` in the socket unit: ``router``, ``admin``); without
names the first fd is the router's, the second the admin API's. Tests and chaos hand sockets over
the same way (harness/handover.py).
"""
from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3
DEFAULT_NAMES = ("router", "admin")
ENV_KEYS = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


class ActivationError(Exception):
    """The inherited fds are not what systemd's protocol promises (one line: what and where)."""


def inherited_sockets(env: dict[str, str] | None = None, pid: int | None = None) -> dict[str, socket.socket]:
    """name -> listening TCP socket passed to this process; {} if none (or meant for another pid).

    The variables are removed from ``os.environ`` (when ``env`` is it), so children never believe
    the fds are theirs; the sockets are made non-inheritable.
    """
    environ = os.environ if env is None else env
    pid = os.getpid() if pid is None else pid
    count, target = environ.get("LISTEN_FDS", ""), environ.get("LISTEN_PID", "")
    names_raw = environ.get("LISTEN_FDNAMES", "")
    for key in ENV_KEYS:
        environ.pop(key, None)
    if not count:
        return {}
    if not target.isdigit() or int(target) != pid:
        return {}  # meant for another process (sd_listen_fds ignores them too)
    if not count.isdigit() or not 1 <= int(count) <= 16:
        raise ActivationError(f"LISTEN_FDS={count!r}: expected a number of fds from 1 to 16")
    n = int(count)
    names = names_raw.split(":") if names_raw else list(DEFAULT_NAMES[:n])
    if len(names) != n:
        raise ActivationError(f"LISTEN_FDNAMES={names_raw!r} names {len(names)} fds, LISTEN_FDS={n}")
    out: dict[str, socket.socket] = {}
    for i, name in enumerate(names):
        fd = SD_LISTEN_FDS_START + i
        try:
            sock = socket.socket(fileno=fd)
        except OSError as e:
            raise ActivationError(f"fd {fd} ({name}) from LISTEN_FDS: {e.strerror}") from None
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) \
                or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.detach()
            raise ActivationError(f"fd {fd} ({name}) from LISTEN_FDS: expected a listening TCP socket "
                                  "(ListenStream= in the socket unit)")
        if name in out:
            raise ActivationError(f"LISTEN_FDNAMES={names_raw!r}: {name!r} twice")
        sock.set_inheritable(False)
        out[name] = sock
    unknown = set(out) - set(DEFAULT_NAMES)
    if unknown:
        raise ActivationError(f"LISTEN_FDNAMES: unknown socket name(s) {sorted(unknown)}; "
                              f"expected {' and/or '.join(DEFAULT_NAMES)} (FileDescriptorName=)")
    return out
