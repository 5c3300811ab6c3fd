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
