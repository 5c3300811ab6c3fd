"""Forking a child that must never return into its parent's code."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, NoReturn


def fork_into(body: Callable[[], int]) -> int:
    """Fork; the child runs `body` and leaves with its exit code (SystemExit honoured, crashes
    printed, output flushed) through os._exit. Returns the child's pid in the parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    _exit_with(body)


def _exit_with(body: Callable[[], int]) -> NoReturn:
    rc = 1
    try:
        rc = body()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
