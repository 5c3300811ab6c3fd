"""Memory of the supervisor's process tree (psutil) and of the GPUs (nvidia-smi, if present)."""
from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import psutil

from .schema import MemorySample


def pid_listening_on(url: str) -> int | None:
    """The pid of the process listening on the TCP port of `url` (needs the right to see it)."""
    port = urlsplit(url).port
    if port is None:
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, PermissionError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return c.pid
    return None


def gpu_used_bytes(timeout_s: float = 5.0) -> list[int] | None:
    """Memory in use per GPU from nvidia-smi; None without nvidia-smi or if it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        ).stdout
        return [int(float(line)) << 20 for line in out.split() if line.strip()]
    except (subprocess.SubprocessError, OSError, ValueError):
        return None


def sample_tree(pid: int | None, t: float | None = None, also: Iterable[int] = ()) -> MemorySample:
    """RSS and PSS summed over `pid` and all its descendants, plus GPU memory. `also`: more roots
    (children a restarted supervisor re-adopted are not its descendants), each counted once."""
    sample = MemorySample(t=time.time() if t is None else t, gpu_used_bytes=gpu_used_bytes())
    if pid is None:
        sample.error = "supervisor pid unknown (not in /status, not found listening on the admin port)"
        return sample
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error as exc:
        sample.error = f"supervisor pid {pid}: {type(exc).__name__}"
        return sample
    seen = {p.pid for p in procs}
    for other in also:
        try:
            other_root = psutil.Process(other)
            tree = [other_root, *other_root.children(recursive=True)]
        except psutil.Error:
            continue
        procs += [p for p in tree if p.pid not in seen]
        seen.update(p.pid for p in tree)
    rss, pss, pss_ok = 0, 0, True
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            continue  # exited between listing and reading
        sample.processes += 1
        try:
            pss += p.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pss_ok = False
    sample.rss_bytes = rss
    sample.pss_bytes = pss if pss_ok else None
    return sample


def growth_pct(start: float | None, end: float | None) -> float | None:
    """(end - start) / start in percent; None if either is missing or start is 0."""
    if not start or end is None:
        return None
    return 100.0 * (end - start) / start
