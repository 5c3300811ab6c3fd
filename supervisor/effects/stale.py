"""A runtime dir left by an earlier supervisor: refuse to share it with a live one, and clean up the
children of a dead one (a SIGKILLed supervisor leaves daemons holding memory)."""
from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import psutil

log = logging.getLogger("understudy")


class RuntimeDirInUse(Exception):
    pass


def _alive_supervisor(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and any("supervisor" in a or "understudy" in a for a in p.cmdline())
    except psutil.Error:
        return False


def check_and_clean(rd: Path, kill: bool = True) -> list[int]:
    """RuntimeDirInUse if a live supervisor owns ``rd``; otherwise SIGKILL the process groups of the
    children the dead one recorded (only those whose command line names ``rd``); returns them.
    ``kill=False``: only the check (the children are re-adopted or stopped by the first pass: supervisor/core/adoption.py)."""
    try:
        st = json.loads((rd / "state.json").read_text())
    except (OSError, ValueError):
        return []
    pid = st.get("pid")
    if isinstance(pid, int) and pid != os.getpid() and _alive_supervisor(pid) and not st.get("stopped"):
        raise RuntimeDirInUse(f"runtime_dir {rd} is in use by a running supervisor (pid {pid}); "
                              "stop it first or set another runtime_dir")
    if not kill:
        return []
    pids = [e.get("pid") for e in st.get("engines", [])] + [d.get("pid") for d in st.get("daemons", [])]
    pids.append((st.get("spawn_server") or {}).get("pid"))
    killed = []
    for p in pids:
        if not isinstance(p, int):
            continue
        try:
            proc = psutil.Process(p)
            if str(rd) not in " ".join(proc.cmdline()):
                continue
            os.killpg(p, signal.SIGKILL)
            killed.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    if killed:
        log.warning("killed %d processes left by a previous supervisor in %s: %s", len(killed), rd, killed)
    return killed
