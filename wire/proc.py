"""What /proc says about a process: its start time (to tell a reused pid apart) and whether it has
begun to exit (after which it runs no more user code)."""
from __future__ import annotations

PF_EXITING = 0x4  # include/linux/sched.h: the task has begun do_exit()


def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (field 3 first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rfind(b")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22), or None if it is gone."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields else None


def is_exiting(pid: int) -> bool:
    """True once ``pid`` has begun to exit (or is gone), before its pidfd turns readable.

    A process that held a GPU spends ~100 ms in the kernel tearing its CUDA context down
    before the exit is reported; it runs no user code after SIGKILL, so it is already dead
    for the purpose of failover. Reads PF_EXITING from /proc/<pid>/stat (field 9).
    """
    fields = proc_stat(pid)
    return fields is None or fields[0] in (b"Z", b"X") or bool(int(fields[6]) & PF_EXITING)


def runs_user_code(pid: int, started: int) -> bool:
    """The process that started at `started` ticks still exists and has not begun to exit."""
    return pid > 0 and start_ticks(pid) == started and not is_exiting(pid)
