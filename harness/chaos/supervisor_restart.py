"""The `kill-supervisor` fault: SIGKILL the supervisor and start it again on the same listening
sockets, as systemd's understudy.socket + Restart= would. Its children must survive and be
re-adopted (same engine pids), and no connection may be refused meanwhile.

Under systemd (the supervisor's environment has INVOCATION_ID) only the SIGKILL is sent: systemd
holds the socket and restarts the service. Otherwise chaos takes copies of the supervisor's
listening sockets first (pidfd_getfd(2)), so the kernel keeps queueing connections while nobody
accepts, then starts the same command line with the sockets handed over (LISTEN_FDS).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil

SYS_PIDFD_GETFD = 438  # same number on x86_64 and aarch64
DEATH_WAIT_S = 10.0


class RestartError(RuntimeError):
    """The fault could not be injected as asked; one line saying why."""


def pidfd_getfd(pid: int, fd: int) -> int:
    """A copy (in this process) of file descriptor `fd` of process `pid`."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        new = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if new < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid {pid}, fd {fd}): {os.strerror(err)}")
        return new
    finally:
        os.close(pidfd)


def _listening_fds(proc: psutil.Process, admin_url: str) -> dict[str, int]:
    """{'router': fd, 'admin': fd} of the supervisor's listening TCP sockets (the admin one by port)."""
    admin_port = urlsplit(admin_url).port
    out: dict[str, int] = {}
    for c in proc.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.fd >= 0:
            out["admin" if c.laddr.port == admin_port else "router"] = c.fd
    if set(out) != {"router", "admin"}:
        raise RestartError(f"supervisor pid {proc.pid}: expected a router and an admin listening socket, "
                           f"found {sorted(out)}")
    return out


def _log_target(proc: psutil.Process, fallback: Path) -> Path:
    """Where the supervisor's stdout went if it was a file (the restarted one appends there)."""
    try:
        path = Path(os.readlink(f"/proc/{proc.pid}/fd/1"))
        if path.is_file():
            return path
    except OSError:
        pass
    return fallback


def kill_and_restart(pid: int, admin_url: str, log_fallback: Path) -> dict:
    """SIGKILL `pid` and, unless systemd restarts it, start it again on its own sockets; the detail
    for the fault record (`restarted_by`, `new_pid`, `down_s`, `killed_at`: wall time once SIGKILL was sent)."""
    try:
        proc = psutil.Process(pid)
        argv, cwd, env = proc.cmdline(), proc.cwd(), proc.environ()
    except psutil.Error as exc:
        raise RestartError(f"supervisor pid {pid}: {type(exc).__name__}") from None
    if "INVOCATION_ID" in env:  # systemd's service: it holds the socket and restarts it
        os.kill(pid, signal.SIGKILL)
        return {"restarted_by": "systemd"}
    fds = _listening_fds(proc, admin_url)
    held: dict[str, int] = {}
    try:
        for name, fd in fds.items():
            held[name] = pidfd_getfd(pid, fd)
    except OSError as exc:
        for fd in held.values():
            os.close(fd)
        raise RestartError(f"cannot hold the supervisor's sockets ({exc}); not killed") from None
    try:
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()  # nothing it accepts after this: what the new one takes is never lost
        while time.time() - t0 < DEATH_WAIT_S:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.005)
        else:
            raise RestartError(f"supervisor pid {pid} still alive {DEATH_WAIT_S:g}s after SIGKILL")
        from harness.handover import handover_argv
        from supervisor.effects.socket_activation import ENV_KEYS
        env = {k: v for k, v in env.items() if k not in ENV_KEYS}
        names = list(held)
        log = _log_target(proc, log_fallback)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            new = subprocess.Popen(handover_argv([held[n] for n in names], names, argv), cwd=cwd, env=env,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   pass_fds=list(held.values()), start_new_session=True)
        return {"restarted_by": "chaos", "new_pid": new.pid, "down_s": round(time.time() - t0, 3),
                "killed_at": killed_at, "log": str(log)}
    finally:
        for fd in held.values():
            os.close(fd)
