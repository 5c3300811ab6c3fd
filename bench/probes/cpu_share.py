"""CPU share of processes (all their threads) over a window, from /proc: 1.0 is one core busy.

    python bench/probes/cpu_share.py SECONDS name=pid [name=pid ...]
"""
from __future__ import annotations

import os
import sys
import time


def stat_seconds(path: str) -> float:
    """User + system CPU seconds from a /proc `stat` file (a process's or a thread's)."""
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process, all its threads."""
    return stat_seconds(f"/proc/{pid}/stat")


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread, keyed `name/tid` (Python's threads all carry the process's name)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            out[f"{name}/{tid}"] = stat_seconds(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return out


def main() -> None:
    seconds = float(sys.argv[1])
    procs = dict(arg.split("=") for arg in sys.argv[2:])
    before = {n: (cpu_seconds(int(p)), thread_seconds(int(p))) for n, p in procs.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    for name, pid in procs.items():
        total, threads = cpu_seconds(int(pid)), thread_seconds(int(pid))
        parts = ", ".join(f"{t} {(s - before[name][1].get(t, 0.0)) / wall:.2f}"
                          for t, s in sorted(threads.items(), key=lambda kv: -kv[1] + before[name][1].get(kv[0], 0.0))
                          if s - before[name][1].get(t, 0.0) > 0.01 * wall)
        print(f"{name:9} {(total - before[name][0]) / wall:5.2f} cores  ({parts})")


if __name__ == "__main__":
    main()
