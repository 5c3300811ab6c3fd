"""Re-adoption as the first pass: a supervisor that finds its predecessor's records observes what is
left (Survey), checks what may be adopted (CheckAdoptable), decides (adoption_plan.plan_adoption),
then stops what is not wanted and attaches to what is; the boot starts the rest once the stopped
ones are gone. If anything of this fails, every recorded child still alive is stopped and the node
starts afresh: never a crash loop on bad records."""
from __future__ import annotations

import logging
from supervisor.core import daemons, lifecycle
from supervisor.core.actions import Attach, AwaitGone, CheckAdoptable, Fence, Publish, Survey
from supervisor.core.adoption_plan import AdoptionPlan, plan_adoption
from supervisor.core.events import AdoptionChecked, GroupsGone, Surveyed
from supervisor.core.failover import promote, restore_primary
from supervisor.core.model import Adoption, Daemon, Engine, Node, SpawnServer
from supervisor.core.records import ChildRecord, same_process
from supervisor.core.states import RUNNING, Intent, Role, State

log = logging.getLogger("understudy")


def advance(node: Node) -> None:
    """The first pass asks for the survey."""
    a = node.adoption
    if a is not None and a.stage == "begin":
        a.stage = "survey"
        node.emit(Survey(a.records))


def surveyed(node: Node, ev: Surveyed) -> None:
    a = node.adoption
    if a is None or a.stage != "survey":
        return
    if ev.error:
        give_up(node, f"survey failed: {ev.error}")
        return
    a.observed, a.spawn_children = dict(ev.observed), tuple(ev.spawn_children)
    first = plan_adoption(a.records, a.observed, node.wanted)
    a.stage = "check"
    node.emit(CheckAdoptable(tuple(first.adopt)))


def checked(node: Node, ev: AdoptionChecked) -> None:
    a = node.adoption
    if a is None or a.stage != "check":
        return
    if ev.error:
        give_up(node, f"checks failed: {ev.error}")
        return
    try:
        apply(node, a, plan_adoption(a.records, a.observed, node.wanted, ev.failed), ev)
    except Exception:  # noqa: BLE001 (a bug: never a crash loop on bad records)
        log.exception("re-adoption failed")
        give_up(node, "re-adoption failed")


def apply(node: Node, a: Adoption, plan: AdoptionPlan, ev: AdoptionChecked) -> None:
    """Stop what is not wanted, attach to what is, restore roles, epoch and the drained flag."""
    records = a.records
    for rec, why in plan.gone:
        log.info("previous %s %s (pid %d): %s", rec.kind, rec.name, rec.pid, why)
    adopted, recorded = {r.pid for r in plan.adopt}, {r.pid for r in records.children}
    strays = [p for p in a.spawn_children if p not in adopted and p not in recorded]
    for rec, why in plan.stop:
        log.warning("previous %s %s (pid %d) stopped, not adopted: %s", rec.kind, rec.name, rec.pid, why)
        node.emit(Fence(rec.name, rec.pid))
    for pid in strays:  # engines whose spawn the dead supervisor never heard the answer of
        log.warning("engine pid %d, forked by the previous spawn server but in no record (its spawn was in "
                    "flight), stopped", pid)
        node.emit(Fence(f"pid {pid}", pid))
    spawn_rec = plan.adopted("spawn_server").get("spawn-server")
    if spawn_rec is not None and node.spawn is not None:
        adopt_spawn_server(node, node.spawn, spawn_rec)
    for name, rec in plan.adopted("daemon").items():
        d = next(d for d in node.daemons if d.name == name)
        adopt_daemon(node, d, rec, ev.daemon_info.get(name, {}))
    for name, rec in plan.adopted("engine").items():
        adopt_engine(node, node.engines[name], rec, spawned=rec.spawned and spawn_rec is not None)
    if records.drained and not records.stopped:
        node.drained = True
        log.warning("node still drained (by an admin before the previous supervisor died): /readyz fails "
                    "until `understudy undrain`")
    if plan.primary is not None:
        e = node.engines[plan.primary]
        if plan.promoted:  # the recorded primary did not survive: a failover, counted as one
            node.epoch = plan.epoch - 1
            promote(node, e, "supervisor-restart", node.now, records.primary or "")
        else:
            restore_primary(node, e, plan.epoch)
    if plan.adopt:
        names = ", ".join(f"{r.name} (pid {r.pid})" for r in plan.adopt)
        log.info("re-adopted from the previous supervisor (pid %d): %s, %.2f s after this process started; "
                 "adopted processes are not our children: their exit codes are read while init has not reaped "
                 "them, else unknown",
                 records.supervisor_pid, names, ev.since_start)
    node.emit(Publish({"type": "adopted", "previous_supervisor": records.supervisor_pid,
                       "adopted": [r.name for r in plan.adopt], "stopped": [r.name for r, _ in plan.stop],
                       "primary": plan.primary, "epoch": node.epoch}))
    clear(node, [r.pid for r, _ in plan.stop] + strays)


def adopt_spawn_server(node: Node, s: SpawnServer, rec: ChildRecord) -> None:
    s.incarnation, s.pid, s.started_at = max(rec.incarnation, s.incarnation + 1), rec.pid, node.now
    node.emit(Attach(s.kind, s.name, s.incarnation, rec.pid))
    lifecycle.transition(node, s, State.STARTING, f"adopting pid {rec.pid}")
    s.ever_ready = True
    lifecycle.transition(node, s, State.READY, "adopted")
    log.info("spawn server adopted (pid %d)", rec.pid)


def adopt_daemon(node: Node, d: Daemon, rec: ChildRecord, info: dict) -> None:
    d.incarnation, d.pid, d.started_at = rec.incarnation, rec.pid, node.now
    d.intent, d.check_failures = Intent.RUN, 0
    node.emit(Attach(d.kind, d.name, d.incarnation, rec.pid))
    lifecycle.transition(node, d, State.STARTING, f"adopting pid {rec.pid} (incarnation {rec.incarnation}) from "
                                                  "the previous supervisor")
    daemons.ready(node, d, info)


def adopt_engine(node: Node, e: Engine, rec: ChildRecord, spawned: bool) -> None:
    now = node.now
    e.incarnation, e.port, e.url, e.pid, e.spawned = rec.incarnation, rec.port, rec.url, rec.pid, spawned
    e.intent = Intent.RUN
    e.role = Role.STANDBY
    e.started_at = now
    e.last_heartbeat = now  # an engine that never reconnects its control channel is a hang
    node.emit(Attach(e.kind, e.name, e.incarnation, rec.pid, spawned))
    lifecycle.transition(node, e, State.STARTING, f"adopting pid {rec.pid} (incarnation {rec.incarnation}) from "
                                                  "the previous supervisor")
    e.policy.record_success()
    e.ever_ready = True
    e.last_progress = e.last_check = now
    lifecycle.transition(node, e, State.READY, f"adopted: {rec.url}/health answered; exit status will be "
                         + ("reported by the spawn server" if spawned else "read from /proc if init has not "
                            "reaped it yet"))


def give_up(node: Node, why: str) -> None:
    """SIGKILL every recorded child still alive (pid and start time checked), forget anything half
    adopted, and boot afresh once they are gone."""
    a = node.adoption
    log.error("%s; stopping the previous supervisor's children and starting afresh", why)
    node.primary, node.hold_reason = None, "starting: no engine READY yet"
    for child in node.children():
        child.pid, child.spawned = None, False
        if child.state in RUNNING:
            lifecycle.transition(node, child, State.FAILED, "re-adoption failed")
        if child.state != State.STOPPED:
            lifecycle.transition(node, child, State.STOPPED, "re-adoption failed")
        if isinstance(child, Engine):
            child.role = Role.STANDBY
    pids = [r.pid for r in a.records.children if same_process(r.create_time, a.observed.get(r.pid))]
    for pid in pids:
        node.emit(Fence(f"pid {pid}", pid))
    clear(node, pids)


def clear(node: Node, pids: list[int]) -> None:
    """A stopped daemon must release its lock and memory before a new one starts: wait for them."""
    if pids:
        node.adoption.stage = "clear"
        node.emit(AwaitGone(tuple(pids)))
    else:
        done(node)


def gone(node: Node, ev: GroupsGone) -> None:
    if node.adoption is not None and node.adoption.stage == "clear":
        done(node)


def done(node: Node) -> None:
    node.adoption = None
    node.phase = "booting"
    node.dirty = True
