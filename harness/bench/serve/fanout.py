"""One sweep point spread over several client processes (`--client-procs`), for loads where one
Python event loop would be the bottleneck. Each process runs the same closed loop on its share of
the requests and workers; they start together (ready/go over their stdin and stdout, JSON lines),
and the point's wall time runs from the first send to the last answer (perf_counter is the
system-wide monotonic clock on Linux, so the processes' times compare)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .client import RequestResult
from harness import ROOT


def shares(n_bodies: int, concurrency: int, procs: int) -> list[tuple[list[int], int]]:
    """(request indices, workers) per process: requests dealt round-robin, workers as evenly."""
    procs = max(1, min(procs, concurrency, n_bodies))
    return [(list(range(i, n_bodies, procs)), concurrency // procs + (i < concurrency % procs))
            for i in range(procs)]


def run_point_procs(url: str, path: str, bodies: list[bytes], concurrency: int, timeout_s: float,
                    duration_s: float | None, procs: int) -> tuple[list[RequestResult], float]:
    """Like client.run_point, over `procs` processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    children = []
    try:
        for idx, workers in shares(len(bodies), concurrency, procs):
            p = subprocess.Popen([sys.executable, "-m", "harness.bench.serve.client_proc"], cwd=ROOT, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            job = {"url": url, "path": path, "bodies": [bodies[i].decode() for i in idx], "concurrency": workers,
                   "timeout_s": timeout_s, "duration_s": duration_s}
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
            children.append(p)
        for p in children:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"client process {p.pid} did not start (exit {p.wait()})")
        for p in children:
            p.stdin.write("go\n")
            p.stdin.flush()
        results: list[RequestResult] = []
        starts, ends = [], []
        for p in children:
            line = p.stdout.readline()
            if p.wait() != 0 or not line:
                raise RuntimeError(f"client process {p.pid} failed (exit {p.returncode})")
            out = json.loads(line)
            starts.append(out["start"])
            ends.append(out["end"])
            results += [RequestResult(**r) for r in out["results"]]
        return results, max(ends) - min(starts)
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
                p.wait()
