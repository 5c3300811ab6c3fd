"""Child exits as loop events: one pidfd per process, read by the asyncio loop (no SIGCHLD games)."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from typing import Callable

from wire.proc import is_exiting, proc_stat

log = logging.getLogger("understudy.pidwatch")

PR_SET_CHILD_SUBREAPER = 36


def watch_exit(loop: asyncio.AbstractEventLoop, pid: int, on_exit: Callable[[int], None]) -> Callable[[], None]:
    """Call ``on_exit(pid)`` from the loop once ``pid`` has exited; returns a cancel function.

    Works for any process (not only our children): a pidfd becomes readable when the process
    terminates. A pid that is already gone is reported on the next loop iteration.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        handle = loop.call_soon(on_exit, pid)
        return handle.cancel

    def _ready() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        on_exit(pid)

    loop.add_reader(fd, _ready)

    def cancel() -> None:
        try:
            loop.remove_reader(fd)
            os.close(fd)
        except (OSError, ValueError):
            pass

    return cancel


def foreign_exit(pid: int) -> tuple[bool, int | None]:
    """(exited, returncode) of a process that is not our child (re-adopted, or forked by a spawn
    server that was replaced since): its exit status is in /proc/<pid>/stat (field 52, as waitpid
    reports it) while it is a zombie of its new parent (init, which reaps it soon: best effort);
    (True, None) once it is reaped, (False, None) while it runs or tears down."""
    fields = proc_stat(pid)
    if fields is None:
        return True, None
    if fields[0] not in (b"Z", b"X"):
        return False, None
    try:
        return True, os.waitstatus_to_exitcode(int(fields[49]))
    except (IndexError, ValueError):
        return True, None


def is_our_child(pid: int) -> bool:
    """Whether ``pid`` is a child of ours (waitpid would work), without reaping it."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return True
    except ChildProcessError:
        return False


def become_subreaper() -> bool:
    """Adopt orphaned descendants (engines whose spawn server died), so their exit codes stay ours."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


def try_reap(pid: int) -> int | None:
    """Reap ``pid`` if it is our exited child; its subprocess-style returncode, else None."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if got == pid else None


def reap_orphans(known: set[int]) -> list[tuple[int, int | None]]:
    """Reap exited children that nobody else waits for (adopted orphans); returns (pid, rc)."""
    import psutil
    out = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return out
    for child in children:
        if child.pid in known:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        rc = try_reap(child.pid)
        out.append((child.pid, rc))
    return out
