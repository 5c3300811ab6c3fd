"""One client process of `--client-procs` (see fanout.py): a job on stdin as one JSON line, "ready",
wait for "go", run the closed loop, print the results as one JSON line."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time

from .client import run_point


def main() -> int:
    job = json.loads(sys.stdin.readline())
    bodies = [b.encode() for b in job["bodies"]]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start = time.perf_counter()
    results, elapsed = asyncio.run(run_point(job["url"], job["path"], bodies, job["concurrency"], job["timeout_s"],
                                             job["duration_s"], progress_every_s=3600.0))
    print(json.dumps({"start": start, "end": start + elapsed,
                      "results": [dataclasses.asdict(r) for r in results]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
