"""Decode exit statuses the way an operator wants to read them."""
from __future__ import annotations

import signal


def describe_returncode(rc: int | None) -> str:
    """``-9`` -> 'killed by SIGKILL', ``3`` -> 'exit code 3', None -> 'exit status unknown'."""
    if rc is None:
        return "exit status unknown"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name}"
    return f"exit code {rc}"


def returncode_from_wait_status(status: int) -> int | None:
    """os.waitpid status -> subprocess-style returncode (negative = signal)."""
    import os
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return None
