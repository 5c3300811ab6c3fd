"""One chaos run: preflight, load + events + status polls, faults, settle, report (always written)."""
from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx

from .admin import AdminClient, AdminError
from .analysis import RunData, build_report
from .faults import FaultInjector
from .listener import EventListener
from .loadgen import LoadGenerator
from .memory import pid_listening_on, sample_tree
from harness.prometheus import MetricsParseError, MetricsSnapshot
from .options import ChaosOptions
from .poller import StatusPoller
from .schema import ChaosReport
from .status_view import events_endpoint, parse_status, supervisor_pid
from .writer import write_report


class ChaosAbort(RuntimeError):
    """The run cannot go on; the message (one line) goes into the report."""


async def run_chaos(opts: ChaosOptions) -> tuple[ChaosReport, list[str]]:
    """Run, then build and write the report (partial if the run was cut short)."""
    t0 = time.time()
    data = RunData(t0=t0, t_end=t0, options=opts.public(),
                   target={"data_url": opts.data_url, "admin_url": opts.admin_url,
                           "events_endpoint": opts.events_endpoint or "(from /status)"})
    admin = AdminClient(opts.admin_url, opts.token)
    try:
        await _run(opts, data, admin, deadline=t0 + opts.duration_s)
    except ChaosAbort as exc:
        data.aborted = str(exc)
    except asyncio.CancelledError:
        data.aborted = "interrupted"
    except Exception as exc:  # noqa: BLE001 - a bug in chaos must still leave the partial report
        traceback.print_exc()
        data.aborted = f"internal error in chaos: {type(exc).__name__}: {exc}"
    finally:
        data.t_end = time.time()
        await admin.close()
    report = build_report(data)
    files = write_report(Path(opts.out_dir), report, data)
    return report, files


async def _preflight(opts: ChaosOptions, admin: AdminClient, data: RunData) -> str:
    """Check both ports answer and the token works; return the model id to request."""
    try:
        status = await admin.status()
    except AdminError as exc:
        raise ChaosAbort(str(exc)) from None
    async with httpx.AsyncClient(base_url=opts.data_url, timeout=5.0, trust_env=False) as http:
        try:
            health = await http.get("/healthz")
            models = await http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ChaosAbort(f"data plane unreachable: {opts.data_url}: {type(exc).__name__}: {exc}") from None
    if health.status_code != 200:
        raise ChaosAbort(f"GET {opts.data_url}/healthz: expected 200, got {health.status_code}")
    pid = opts.supervisor_pid or supervisor_pid(status) or pid_listening_on(opts.admin_url)
    data.memory.supervisor_pid = pid
    data.target["events_endpoint"] = opts.events_endpoint or events_endpoint(status) or ""
    if not data.target["events_endpoint"]:
        data.notes.append("no events endpoint (not given, not in /status): recoveries from /status polls only")
    try:
        return str(models.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        data.notes.append(f"GET /v1/models answered {models.status_code} without a model id; using 'default'")
        return "default"


async def _metrics(admin: AdminClient, data: RunData, when: str) -> MetricsSnapshot | None:
    try:
        return MetricsSnapshot.parse(await admin.metrics())
    except (AdminError, MetricsParseError) as exc:
        data.notes.append(f"/metrics at {when} not read: {exc}")
        return None


async def _race(aw: Awaitable[Any], dead: asyncio.Event, timeout: float) -> None:
    """Await `aw` unless the supervisor is declared dead or `timeout` passes first."""
    task = asyncio.ensure_future(aw)
    dead_task = asyncio.ensure_future(dead.wait())
    try:
        await asyncio.wait({task, dead_task}, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        dead_task.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _sample_tree(data: RunData, admin: AdminClient | None):
    """The supervisor's tree; after a `kill-supervisor` fault, the new supervisor's, plus the children
    it re-adopted (engines, daemons, spawn server as /status lists them: not its descendants)."""
    also: list[int] = []
    try:
        if admin is None:  # the supervisor stopped answering
            raise AdminError("not asked")
        now = parse_status(await admin.status(), time.time())
        if now.supervisor_pid:
            data.memory.supervisor_pid = now.supervisor_pid
        also = [v.pid for v in now.engines + now.daemons if v.pid] + \
            ([now.spawn_server_pid] if now.spawn_server_pid else [])
    except AdminError:
        pass  # the supervisor's own tree only
    return await asyncio.to_thread(sample_tree, data.memory.supervisor_pid, None, also)


async def _memory_loop(opts: ChaosOptions, data: RunData, stop: asyncio.Event, admin: AdminClient) -> None:
    while not stop.is_set() and len(data.memory.samples) < 10_000:
        try:
            await asyncio.wait_for(stop.wait(), timeout=opts.memory_every_s)
            return
        except asyncio.TimeoutError:
            data.memory.samples.append(await _sample_tree(data, admin))


async def _run(opts: ChaosOptions, data: RunData, admin: AdminClient, deadline: float) -> None:
    model = await _preflight(opts, admin, data)
    data.metrics_before = await _metrics(admin, data, "start")
    data.memory.start = await _sample_tree(data, admin)
    stop, stop_load = asyncio.Event(), asyncio.Event()
    max_polls = int(opts.duration_s / opts.status_poll_s) + 10
    poller = StatusPoller(admin, opts.status_poll_s, opts.dead_after_s, max_polls)
    listener = EventListener(data.target["events_endpoint"]) if data.target["events_endpoint"] else None
    load = LoadGenerator(opts.data_url, model, rate=opts.rate, concurrency=opts.concurrency, mix=opts.mix,
                         stream_fraction=opts.stream_fraction, max_tokens=opts.max_tokens,
                         timeout_s=opts.request_timeout_s, seed=opts.seed)
    injector = FaultInjector(admin, opts.fault_plan(), interval_s=opts.interval_s,
                             ready_timeout_s=opts.ready_timeout_s, stop_release_s=opts.stop_release_s,
                             seed=opts.seed, log_dir=opts.out_dir, data_url=opts.data_url,
                             idle_connections=opts.idle_connections, idle_hold_s=opts.idle_hold_s)
    background = [asyncio.create_task(poller.run(stop)), asyncio.create_task(_memory_loop(opts, data, stop, admin))]
    if listener is not None:
        background.append(asyncio.create_task(listener.run(stop)))
    load_task = asyncio.create_task(load.run(stop_load, deadline))
    try:
        await _race(asyncio.sleep(opts.warmup_s), poller.dead, deadline - time.time())
        if not poller.dead.is_set():
            await _race(injector.run(stop, deadline), poller.dead, deadline - time.time())
        if not poller.dead.is_set():
            await _race(injector.wait_settled(stop, deadline, opts.settle_s), poller.dead, deadline - time.time())
    finally:
        stop_load.set()
        await asyncio.wait({load_task}, timeout=opts.request_timeout_s + 5.0)
        injector.release_stopped(older_than=0.0)
        if not poller.dead.is_set():
            data.metrics_after = await _metrics(admin, data, "end")
        data.memory.end = await _sample_tree(data, None if poller.dead.is_set() else admin)
        stop.set()
        await asyncio.wait(background, timeout=5.0)
        for task in [load_task, *background]:
            task.cancel()
        data.requests, data.not_sent = load.records, load.not_sent
        data.faults = injector.faults
        data.samples = poller.samples
        data.notes += injector.notes
        if listener is not None:
            listener.close()
            data.events, data.event_errors = listener.events, listener.errors
            if listener.frames == 0:
                data.notes.append(f"no event received on {listener.endpoint} (wrong runtime dir or no PUB socket?)")
    if poller.dead_reason:
        raise ChaosAbort(poller.dead_reason)
    if time.time() >= deadline and len(injector.faults) < len(injector.plan):
        data.notes.append(f"duration limit {opts.duration_s:g} s reached after "
                          f"{len(injector.faults)} of {len(injector.plan)} faults")
