"""Signal a child's process group safely: only a live group leader, never our own group."""
from __future__ import annotations

import os
import signal


class SignalError(RuntimeError):
    """The group was not signalled; the message says why."""


def signal_group(pid: int, sig: signal.Signals) -> None:
    """os.killpg(pid, sig) after checking that `pid` leads its own group and it is not ours."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        raise SignalError(f"pid {pid} is gone (already exited)") from None
    if pgid != pid:
        raise SignalError(f"pid {pid} is not a process-group leader (its group is {pgid}); not signalled")
    if pgid == os.getpgid(0):
        raise SignalError(f"pid {pid} leads chaos's own process group; not signalled")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        raise SignalError(f"process group {pgid} is gone (already exited)") from None
    except PermissionError:
        raise SignalError(f"not allowed to signal process group {pgid}") from None


def group_alive(pgid: int) -> bool:
    """Whether any process is left in group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
