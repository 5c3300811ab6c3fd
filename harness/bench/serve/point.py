"""One sweep point: its requests streamed by a closed loop of `concurrency` workers (harness/load), in
this process or spread over client processes (`--client-procs`, when one Python event loop would be
the bottleneck: each runs the same closed loop on its share of the requests and workers).

A request counts as an error when it cannot connect, gets a non-200 answer, carries an error event
in its stream, or ends without `data: [DONE]` (a cut stream)."""
from __future__ import annotations

import asyncio
import json
import math
import sys

from harness.load.client import Client
from harness.load.jobs import Bodies, Job
from harness.load.processes import ClientProcesses, split
from harness.load.request import COMPLETIONS, Request
from harness.load.result import RequestResult
from harness.load.schedules import closed_loop

from .workloads import RequestSpec


def request_body(model: str, spec: RequestSpec, temperature: float, ignore_eos: bool) -> bytes:
    return json.dumps({"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
                       "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def run_point(url: str, bodies: list[bytes], concurrency: int, timeout_s: float, duration_s: float | None = None,
              procs: int = 1, label: str = "") -> tuple[list[RequestResult], float]:
    """`concurrency` workers send `bodies` in order, each the next one when its previous is done
    (closed loop), over `procs` processes; stop early after `duration_s` (requests in flight
    finish). Returns the results of the requests sent and the wall time from the first send to the
    last answer."""
    procs = max(1, min(procs, concurrency, len(bodies)))
    if procs == 1:
        return asyncio.run(_in_process(url, bodies, concurrency, timeout_s, duration_s, label))
    jobs = [Job(url=url, timeout_s=timeout_s, workers=workers, duration_s=duration_s,
                requests=Bodies(bodies=[b.decode() for b in bodies[i::procs]]))
            for i, workers in enumerate(split(concurrency, procs))]
    with ClientProcesses(jobs) as load:
        reports = load.collect()
    return [r for rep in reports for r in rep.results], max(r.end for r in reports) - min(r.start for r in reports)


async def _in_process(url: str, bodies: list[bytes], concurrency: int, timeout_s: float, duration_s: float | None,
                      label: str, progress_every_s: float = 5.0) -> tuple[list[RequestResult], float]:
    client = Client(url, timeout_s)
    t0 = client.clock()

    async def progress() -> None:
        while True:
            await asyncio.sleep(progress_every_s)
            done = [r for r in client.results if r.end is not None]
            print(f"  {label}{len(done)}/{len(bodies)} done, {sum(not r.ok for r in done)} errors, "
                  f"{client.clock() - t0:.0f} s", file=sys.stderr, flush=True)

    ticker = asyncio.create_task(progress())
    try:
        await closed_loop(client, (Request(COMPLETIONS, b, True) for b in bodies), concurrency,
                          deadline=math.inf if duration_s is None else t0 + duration_s)
    finally:
        ticker.cancel()
    return client.results, client.clock() - t0
