"""Re-adoption effects: observe what a dead supervisor left, decide (``reconcile.plan_adoption``),
then act: stop what is not wanted, attach to what is (pidfd, control channel, roles and epoch).

Functions of the supervisor rather than another mixin: ``snapshot`` builds the records it writes on
every change, ``adopt_children`` runs once at boot, before anything is started.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import psutil

from daemon.cli import daemon_argv
from daemon.runtime_dir import daemon_socket_path
from supervisor.child_records import ChildRecord, ChildRecords, config_key, create_time, same_process
from supervisor.launch import AdoptedHandle, SpawnClient, SpawnedHandle, group_alive, kill_group, python_argv
from supervisor.pidwatch import watch_exit
from supervisor.reconcile import AdoptionPlan, Wanted, plan_adoption
from supervisor.routing import Upstream
from supervisor.states import RUNNING, Role, State

if TYPE_CHECKING:
    from supervisor.arbiter import Supervisor

log = logging.getLogger("understudy")

CHECK_TIMEOUT_S = 2.0
STOP_WAIT_S = 10.0
ENGINE_VOLATILE = {"port", "incarnation", "dist_port", "control_endpoint"}  # differ per incarnation


# ---------------------------------------------------------------------------------- keys, records
def wanted(sup: "Supervisor") -> Wanted:
    """The config key of every slot (what a recorded child must have been started with)."""
    m = sup.cfg.model
    daemons = {}
    for d in sup.daemons:
        gpu = sup.cfg.resolved_gpu_ids()[d.rank] if sup.device == "cuda" else None
        daemons[d.name] = config_key(argv=daemon_argv(sup.model_path, d.rank, m.tp_size, sup.device, m.dtype,
                                                      sup.rd, gpu), fingerprint=sup.fingerprint)
    engines = {}
    for slot in sup.engines.values():
        if sup.external:
            ext = sup.cfg.engines.external
            what = {"command": ext.command, "url": ext.url, "env": ext.env}
        else:
            what = sup.engine_config(slot).model_dump(exclude=ENGINE_VOLATILE)
        engines[slot.name] = config_key(engine=what, spawn=sup.cfg.engines.spawn, fingerprint=sup.fingerprint)
    spawn = None
    if not sup.external and sup.cfg.engines.spawn == "server":
        spawn = config_key(argv=python_argv("engines.spawn_server", "--socket", str(sup.rd / "spawn.sock")))
    return Wanted(daemons, engines, spawn)


def snapshot(sup: "Supervisor") -> ChildRecords:
    """Every child with a pid, as the records file holds it."""
    keys: Wanted = sup.child_keys
    children = []

    def add(kind: str, name: str, pid: int | None, **extra) -> None:
        if not pid:
            return
        started = sup.create_times.get(pid)
        if started is None:
            started = sup.create_times[pid] = create_time(pid)
        if started is None:
            return  # already gone: nothing to adopt
        children.append(ChildRecord(kind=kind, name=name, pid=pid, create_time=started,
                                    config_key=keys.key(kind, name) or "", **extra))

    for d in sup.daemons:
        add("daemon", d.name, d.pid, state=d.state.value, incarnation=d.incarnation)
    if sup.spawn_proc is not None:
        add("spawn_server", "spawn-server", sup.spawn_proc.pid, state="READY" if sup.spawn_client else "STARTING")
    elif sup.spawn_starting is not None:
        add("spawn_server", "spawn-server", sup.spawn_starting.pid, state="STARTING")
    for s in sup.engines.values():
        add("engine", s.name, s.pid, state=s.state.value, incarnation=s.incarnation, role=s.role.value,
            port=s.port, url=s.url, spawned=isinstance(s.proc, SpawnedHandle))
    live = {c.pid for c in children}
    for pid in [p for p in sup.create_times if p not in live]:
        del sup.create_times[pid]
    p = sup.table.primary
    return ChildRecords(supervisor_pid=os.getpid(), epoch=sup.epoch, primary=p.name if p else None,
                        drained=sup.table.drained, stopped=sup.final, children=children)


# ---------------------------------------------------------------------------------- observe
async def _check(sup: "Supervisor", rec: ChildRecord) -> str | None:
    """None if the child answers as the recorded one would; else why not."""
    try:
        if rec.kind == "engine":
            # (an external engine may serve from a child process: its URL answering is the check)
            if not sup.external and not _listens_on(rec.pid, rec.port):
                return f"pid {rec.pid} (or its HTTP front end) does not listen on port {rec.port}"
            status, _ = await sup.http.fetch("GET", rec.url, "/health", timeout_s=CHECK_TIMEOUT_S)
            return None if status == 200 else f"GET {rec.url}/health answered {status}"
        if rec.kind == "daemon":
            from supervisor.daemon_ops import daemon_status
            rank = int(rec.name.removeprefix("daemon-rank"))
            reply = await asyncio.to_thread(daemon_status, str(daemon_socket_path(sup.rd, rank)), CHECK_TIMEOUT_S)
            info = reply.get("daemon") or {}
            if reply.get("type") != "ok" or info.get("state") != "ready":
                return f"status answered {reply.get('type')} / {info.get('state')}"
            if info.get("pid") not in (None, rec.pid):
                return f"the daemon socket is served by pid {info.get('pid')}, not {rec.pid}"
            sup.adopted_daemon_info[rec.name] = info
            return None
        reply = await SpawnClient(sup.rd / "spawn.sock", CHECK_TIMEOUT_S).call({"op": "ping"})
        return None if reply.get("ok") else f"ping answered {reply}"
    except Exception as e:  # noqa: BLE001 (any failure to answer means: do not adopt)
        return f"{type(e).__name__}: {e}"


def _listens_on(pid: int, port: int) -> bool:
    """The engine (rank 0) or one of its children (its HTTP front end) listens on `port`."""
    try:
        rank0 = psutil.Process(pid)
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for p in [rank0, *rank0.children()] for c in p.net_connections(kind="tcp"))
    except psutil.Error:
        return False


# ---------------------------------------------------------------------------------- act
async def adopt_children(sup: "Supervisor", records: ChildRecords) -> AdoptionPlan:
    """Observe, decide, act. Returns the plan carried out (``plan.slots``: adopt or start)."""
    observed = {r.pid: create_time(r.pid) for r in records.children}
    first = plan_adoption(records, observed, sup.child_keys)
    checks = await asyncio.gather(*(_check(sup, r) for r in first.adopt))
    failed = {r.name: why for r, why in zip(first.adopt, checks) if why is not None}
    plan = plan_adoption(records, observed, sup.child_keys, failed)
    for rec, why in plan.gone:
        log.info("previous %s %s (pid %d): %s", rec.kind, rec.name, rec.pid, why)
    strays = _spawned_strays(records, observed, {r.pid for r in plan.adopt})
    for rec, why in plan.stop:
        log.warning("previous %s %s (pid %d) stopped, not adopted: %s", rec.kind, rec.name, rec.pid, why)
        kill_group(rec.pid, signal.SIGKILL)
    for pid in strays:
        log.warning("engine pid %d, forked by the previous spawn server but in no record (its spawn was in "
                    "flight), stopped", pid)
        kill_group(pid, signal.SIGKILL)
    await _wait_groups_gone([r.pid for r, _ in plan.stop] + strays)
    adopted = plan.adopted("spawn_server")
    if adopted:
        _adopt_spawn_server(sup, adopted["spawn-server"])
    for name, rec in plan.adopted("daemon").items():
        _adopt_daemon(sup, next(d for d in sup.daemons if d.name == name), rec)
    for name, rec in plan.adopted("engine").items():
        _adopt_engine(sup, sup.engines[name], rec)
    if records.drained and not records.stopped:
        sup.table.drained = True
        log.warning("node still drained (by an admin before the previous supervisor died): /readyz fails "
                    "until `understudy undrain`")
    if plan.primary is not None:
        _restore_primary(sup, plan, records)
    if plan.adopt:
        names = ", ".join(f"{r.name} (pid {r.pid})" for r in plan.adopt)
        log.info("re-adopted from the previous supervisor (pid %d): %s, %.2f s after this process started; "
                 "exit codes of adopted processes will be unknown (they are not our children)",
                 records.supervisor_pid, names, _since_process_start())
    sup.events.publish({"type": "adopted", "previous_supervisor": records.supervisor_pid,
                        "adopted": [r.name for r in plan.adopt], "stopped": [r.name for r, _ in plan.stop],
                        "primary": plan.primary, "epoch": sup.epoch})
    return plan


def _since_process_start() -> float:
    """Seconds since this process started (/proc/self/stat starttime vs CLOCK_BOOTTIME)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rfind(b")") + 2:].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


async def adopt_or_clean(sup: "Supervisor", records: ChildRecords) -> AdoptionPlan | None:
    """adopt_children; if that fails (a bug), SIGKILL every recorded child still alive (pid and start
    time checked) and let the boot start everything afresh: never a crash loop on bad records."""
    try:
        return await adopt_children(sup, records)
    except Exception:  # noqa: BLE001
        log.exception("re-adoption failed; stopping the previous supervisor's children and starting afresh")
    for slot in sup.all_slots():  # forget anything half adopted
        if slot.cancel_watch is not None:
            slot.cancel_watch()
        slot.pid, slot.proc, slot.cancel_watch = None, None, None
    sup.spawn_proc = sup.spawn_client = None
    sup.table.set_primary(None, "starting: no engine READY yet")
    pgids = [r.pid for r in records.children if same_process(r.create_time, create_time(r.pid))]
    for pgid in pgids:
        kill_group(pgid)
    await _wait_groups_gone(pgids)
    for slot in sup.all_slots():
        if slot.state in RUNNING:
            sup.transition(slot, State.FAILED, "re-adoption failed")
        if slot.state != State.STOPPED:
            sup.transition(slot, State.STOPPED, "re-adoption failed")
        if hasattr(slot, "role"):
            slot.role = Role.STANDBY
    return None


async def _wait_groups_gone(pgids: list[int]) -> None:
    """A stopped daemon must release its lock and memory before a new one starts."""
    deadline = time.monotonic() + STOP_WAIT_S
    for pgid in pgids:
        while await asyncio.to_thread(group_alive, pgid) and time.monotonic() < deadline:
            kill_group(pgid)
            await asyncio.sleep(0.05)


def _spawned_strays(records: ChildRecords, observed: dict[int, float | None], adopted: set[int]) -> list[int]:
    """Live children of the recorded spawn server that are neither adopted nor recorded: engines whose
    spawn the dead supervisor never heard the answer of. Nobody else would ever stop them."""
    recorded = {r.pid for r in records.children}
    out: list[int] = []
    for rec in records.children:
        if rec.kind != "spawn_server" or not same_process(rec.create_time, observed.get(rec.pid)):
            continue
        try:
            kids = psutil.Process(rec.pid).children()
        except psutil.Error:
            continue
        for kid in kids:
            try:
                leader = kid.status() != psutil.STATUS_ZOMBIE and os.getpgid(kid.pid) == kid.pid  # setsid done
            except (psutil.Error, ProcessLookupError):
                continue
            if leader and kid.pid not in adopted and kid.pid not in recorded:
                out.append(kid.pid)
    return out


def _adopt_spawn_server(sup: "Supervisor", rec: ChildRecord) -> None:
    proc = AdoptedHandle(rec.pid)
    sup.spawn_proc, sup.spawn_client = proc, SpawnClient(sup.rd / "spawn.sock")
    watch_exit(sup.loop, rec.pid, lambda pid: sup._on_spawn_server_exit(proc))
    log.info("spawn server adopted (pid %d)", rec.pid)


def _adopt_daemon(sup: "Supervisor", d, rec: ChildRecord) -> None:
    d.incarnation, d.pid, d.proc = rec.incarnation, rec.pid, AdoptedHandle(rec.pid)
    d.socket_path = str(daemon_socket_path(sup.rd, d.rank))
    d.stop_requested, d.ping_failures, d.started_at = False, 0, time.monotonic()
    inc = d.incarnation
    d.cancel_watch = watch_exit(sup.loop, rec.pid, lambda pid: sup.on_daemon_exit(d, inc, pid))
    sup.transition(d, State.STARTING, f"adopting pid {rec.pid} (incarnation {inc}) from the previous supervisor")
    sup.on_daemon_ready(d, sup.adopted_daemon_info.pop(d.name, {}))


def _adopt_engine(sup: "Supervisor", slot, rec: ChildRecord) -> None:
    now = time.monotonic()
    slot.incarnation, slot.port, slot.url = rec.incarnation, rec.port, rec.url
    slot.pid = rec.pid
    slot.proc = SpawnedHandle(rec.pid, sup.spawn_client) if rec.spawned and sup.spawn_client else AdoptedHandle(rec.pid)
    slot.stop_requested = slot.restart_after_stop = False
    slot.role = Role.STANDBY
    slot.started_at = now
    slot.last_heartbeat = now  # an engine that never reconnects its control channel is a hang
    inc = slot.incarnation
    slot.cancel_watch = watch_exit(sup.loop, rec.pid, lambda pid: sup.on_engine_exit(slot, inc, pid))
    sup.transition(slot, State.STARTING, f"adopting pid {rec.pid} (incarnation {inc}) from the previous supervisor")
    slot.policy.record_success()
    slot.last_progress = slot.last_probe = now
    sup.transition(slot, State.READY, f"adopted: {rec.url}/health answered; exit status will be "
                   + ("reported by the spawn server" if isinstance(slot.proc, SpawnedHandle) else "unknown"))


def _restore_primary(sup: "Supervisor", plan: AdoptionPlan, records: ChildRecords) -> None:
    slot = sup.engines[plan.primary]
    if plan.promoted:  # the recorded primary did not survive: a failover, counted as one
        sup.epoch = plan.epoch - 1
        sup.promote(slot, "supervisor-restart", time.monotonic(), records.primary or "")
        return
    sup.epoch = plan.epoch
    slot.role = Role.PRIMARY
    sup.table.set_primary(Upstream(slot.url, slot.name, sup.epoch))
    log.info("%s is primary again (epoch %d, adopted)", slot.name, sup.epoch)
    sup.refresh_gauges()
    if not sup.announced:
        sup.announced = True
        sup.announce()
