"""One client process of a load spread over several (processes.py). On stdin and stdout, JSON
lines: its Job -> "ready"; "go" -> it runs until its requests run out, its duration passes or
"stop" comes (the requests in flight finish) -> "stopped"; a Collect -> its ProcessReport; exit."""
from __future__ import annotations

import asyncio
import math
import sys
import time

from .client import Client
from .jobs import Collect, Gaps, Job, ProcessReport
from .schedules import closed_loop


async def run(job: Job, client: Client) -> ProcessReport:
    """The job's closed loop, stopped early by a line (or the end) on stdin; when it ran, its CPU."""
    stop, loop, fd = asyncio.Event(), asyncio.get_running_loop(), sys.stdin.fileno()
    loop.add_reader(fd, lambda: (sys.stdin.readline(), stop.set()))
    try:
        cpu0, start = time.process_time(), client.clock()
        deadline = math.inf if job.duration_s is None else start + job.duration_s
        await closed_loop(client, job.requests.requests(), job.workers, stop, deadline)
        return ProcessReport(start=start, end=client.clock(), cpu_s=time.process_time() - cpu0)
    finally:
        loop.remove_reader(fd)


def main() -> int:
    job = Job.model_validate_json(sys.stdin.readline())
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    client = Client(job.url, job.timeout_s)
    report = asyncio.run(run(job, client))
    print("stopped", flush=True)
    while (line := sys.stdin.readline()).strip() == "stop":  # (a stop that came after the load ended)
        pass
    collect = Collect.model_validate_json(line)
    if collect.marks is None:
        report.results = client.results
    else:
        report.gaps = [Gaps.of(r, collect.marks, collect.within, collect.until, collect.itl_marks)
                       for r in client.results]
    print(report.model_dump_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
