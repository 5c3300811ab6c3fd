"""Listening sockets handed over to a command as systemd's socket activation does (fds 3, 4, ...,
LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES; supervisor/effects/socket_activation.py takes them): for tests,
benches and chaos ``kill-supervisor``. ``python -m harness.handover FD[,FD] NAME[:NAME] -- ARGV``."""
from __future__ import annotations

import fcntl
import os
import socket
import sys

from supervisor.effects.socket_activation import SD_LISTEN_FDS_START


def listening(host: str = "127.0.0.1", backlog: int = 4096) -> socket.socket:
    """A listening TCP socket on a free port, to hand over to a supervisor (``Harness(held=...)``)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.bind((host, 0))
    s.listen(backlog)
    return s


def handover_argv(fds: list[int], names: list[str], argv: list[str]) -> list[str]:
    """``argv`` started with listening sockets ``fds`` as systemd would hand them over (fds 3, 4, ...,
    LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES): run it with ``pass_fds=fds``. The trampoline keeps the
    pid (exec), which LISTEN_PID must name. Used by tests and by chaos ``kill-supervisor``."""
    return [sys.executable, "-m", "harness.handover", ",".join(map(str, fds)), ":".join(names),
            "--", *argv]


def _trampoline(args: list[str]) -> None:
    """``FD,FD NAME:NAME -- ARGV``: move the fds to 3, 4, ..., set the variables, exec ARGV."""
    fds, names, sep, *argv = args
    if sep != "--" or not argv:
        raise SystemExit("usage: python -m harness.handover FD[,FD...] NAME[:NAME...] -- ARGV")
    src = [int(f) for f in fds.split(",")]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in src]  # out of the way: a source may sit on 3 or 4
    for fd in src:
        os.close(fd)
    for i, fd in enumerate(high):
        os.dup2(fd, SD_LISTEN_FDS_START + i)  # inheritable
        os.close(fd)
    os.environ.update(LISTEN_FDS=str(len(src)), LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES=names)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    _trampoline(sys.argv[1:])
