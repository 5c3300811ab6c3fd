"""A load spread over client processes, for loads where one Python event loop would be the
bottleneck: one `python -m harness.load.child` per job, started together (each says ready before
any is told go), stopped together, each reporting on its own requests. Their times compare: the
monotonic clock is system-wide on Linux."""
from __future__ import annotations

import os
import subprocess
import sys

from harness import ROOT

from .jobs import Collect, Job, ProcessReport
from .result import GAP_WINDOW_S


def split(total: int, parts: int) -> list[int]:
    """`total` dealt as evenly as can be over `parts`."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class ClientProcesses:
    """`with ClientProcesses(jobs) as load:` every process is running its job; `load.stop()` tells
    them to stop; `load.collect()` waits until each has stopped and returns their reports. A process
    still running when the block ends is killed."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "ClientProcesses":
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        try:
            for job in self.jobs:
                p = subprocess.Popen([sys.executable, "-m", "harness.load.child"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                self.procs.append(p)
                self._tell(p, job.model_dump_json())
            for p in self.procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"client process {p.pid} did not start (exit {p.wait()})")
            for p in self.procs:
                self._tell(p, "go")
        except BaseException:
            self._kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._kill()

    def stop(self) -> None:
        for p in self.procs:
            self._tell(p, "stop")

    def collect(self, marks: list[float] | None = None, within: float = GAP_WINDOW_S,
                until: list[float | None] | None = None, itl_marks: list[int] | None = None) -> list[ProcessReport]:
        """Each process's report once it has stopped: its results whole, or with `marks` each
        request's gaps across them (`RequestResult.gap_across`; whole waits between tokens at `itl_marks`)."""
        for p in self.procs:
            if p.stdout.readline().strip() != "stopped":
                raise RuntimeError(f"client process {p.pid} failed (exit {p.wait()})")
        reports = []
        for p in self.procs:
            self._tell(p, Collect(marks=marks, within=within, until=until, itl_marks=itl_marks or []).model_dump_json())
            line = p.stdout.readline()
            if p.wait(60) != 0 or not line:
                raise RuntimeError(f"client process {p.pid} failed (exit {p.returncode})")
            reports.append(ProcessReport.model_validate_json(line))
        return reports

    @staticmethod
    def _tell(p: subprocess.Popen, line: str) -> None:
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
