"""Re-adoption decisions as a pure function (DESIGN.md §8, reconcile style): from what a previous
supervisor recorded, what is observed now (process start times, health checks) and what the config
wants, decide per child: adopt, stop, or forget; and per slot: adopt or start. No process is touched
here; ``supervisor/core/adoption.py`` applies it, ``supervisor/effects/survey.py`` observes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from supervisor.core.records import ChildRecord, ChildRecords, same_process

ADOPTABLE_STATE = "READY"  # a child caught mid-start or mid-drain is stopped and started afresh


@dataclass(frozen=True)
class Wanted:
    """What the config asks for: slot name -> config key, per kind."""

    daemons: dict[str, str]
    engines: dict[str, str]
    spawn_server: str | None  # its config key; None when engines are not forked by a spawn server

    def key(self, kind: str, name: str) -> str | None:
        if kind == "daemon":
            return self.daemons.get(name)
        if kind == "engine":
            return self.engines.get(name)
        return self.spawn_server if name == "spawn-server" else None


@dataclass
class AdoptionPlan:
    """The decisions. ``slots`` maps every wanted slot to "adopt" or "start"."""

    adopt: list[ChildRecord] = field(default_factory=list)
    stop: list[tuple[ChildRecord, str]] = field(default_factory=list)   # alive and ours, not wanted
    gone: list[tuple[ChildRecord, str]] = field(default_factory=list)   # dead, or the pid was reused
    slots: dict[str, Literal["adopt", "start"]] = field(default_factory=dict)
    primary: str | None = None   # the engine that serves once adopted (None: the first READY one)
    epoch: int = 0               # the epoch it serves under
    promoted: bool = False       # the recorded primary is not adopted: a standby takes over (epoch + 1)

    def adopted(self, kind: str) -> dict[str, ChildRecord]:
        return {r.name: r for r in self.adopt if r.kind == kind}


def plan_adoption(records: ChildRecords | None, observed: dict[int, float | None], wanted: Wanted,
                  failed_checks: dict[str, str] | None = None) -> AdoptionPlan:
    """Decide. ``observed``: pid -> its start time now (None = gone); ``failed_checks``: child name ->
    why its health check failed (such a child is stopped, not adopted)."""
    failed_checks = failed_checks or {}
    plan = AdoptionPlan()
    taken: set[tuple[str, str]] = set()
    children = sorted(records.children, key=lambda r: -r.incarnation) if records else []
    for rec in children:  # the newest incarnation of a name first: an older duplicate is stopped
        verdict = _judge(rec, observed.get(rec.pid), wanted, failed_checks, (rec.kind, rec.name) in taken)
        if verdict is None:
            plan.adopt.append(rec)
            taken.add((rec.kind, rec.name))
        elif verdict[0] == "gone":
            plan.gone.append((rec, verdict[1]))
        else:
            plan.stop.append((rec, verdict[1]))
    adopted = {(r.kind, r.name) for r in plan.adopt}
    for kind, names in (("daemon", wanted.daemons), ("engine", wanted.engines)):
        for name in names:
            plan.slots[name] = "adopt" if (kind, name) in adopted else "start"
    if wanted.spawn_server is not None:
        plan.slots["spawn-server"] = "adopt" if ("spawn_server", "spawn-server") in adopted else "start"
    _choose_primary(plan, records)
    return plan


def _judge(rec: ChildRecord, started: float | None, wanted: Wanted, failed_checks: dict[str, str],
           duplicate: bool) -> tuple[str, str] | None:
    """None = adopt; else ("gone" | "stop", why)."""
    if started is None:
        return "gone", f"pid {rec.pid} is no longer running"
    if not same_process(rec.create_time, started):
        return "gone", f"pid {rec.pid} now belongs to another process (started {started:.2f}, " \
                       f"recorded {rec.create_time:.2f}): never touched"
    key = wanted.key(rec.kind, rec.name)
    if key is None:
        return "stop", f"{rec.kind} {rec.name!r} is not in the config any more"
    if key != rec.config_key:
        return "stop", "started with another config (model, tp, dtype, device or engine settings changed)"
    if duplicate:
        return "stop", f"an older incarnation ({rec.incarnation}) of {rec.name}"
    if rec.state != ADOPTABLE_STATE:
        return "stop", f"recorded in state {rec.state or 'unknown'}, not {ADOPTABLE_STATE}: started afresh"
    if rec.name in failed_checks:
        return "stop", f"failed its check: {failed_checks[rec.name]}"
    return None


def _choose_primary(plan: AdoptionPlan, records: ChildRecords | None) -> None:
    engines = plan.adopted("engine")
    plan.epoch = records.epoch if records else 0
    recorded = records.primary if records else None
    if recorded in engines and engines[recorded].role == "primary":
        plan.primary = recorded
    elif engines:  # the primary died with (or after) the supervisor: a recorded standby serves
        plan.primary = sorted(engines)[0]
        plan.epoch += 1
        plan.promoted = True
