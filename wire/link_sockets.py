"""The files of an engine's two link sockets (front end -> core, core -> front end), by pid, in the
runtime dir: named here, without the engine's imports, so the supervisor can remove those a killed
engine left (supervisor/effects/reaper.py) without importing torch."""
from __future__ import annotations

import os
import re
from pathlib import Path

LINK_SOCKET = re.compile(r"eng-(\d+)-(?:in|out)\.sock")  # (its group: the engine's pid)


def socket_paths(runtime_dir: str | os.PathLike, pid: int) -> tuple[Path, Path]:
    """The files of engine `pid`'s two link sockets: what is left to remove after the engine was
    killed before its front end connected."""
    base = Path(runtime_dir) / f"eng-{pid}"
    return Path(f"{base}-in.sock"), Path(f"{base}-out.sock")


def remove_sockets(runtime_dir: str | os.PathLike, pid: int) -> list[Path]:
    """Remove engine `pid`'s link socket files if they are there; returns those removed. Call it
    once the engine has exited, before its pid can name a new engine (a child: right after reaping
    it, before starting another)."""
    removed = []
    for path in socket_paths(runtime_dir, pid):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
