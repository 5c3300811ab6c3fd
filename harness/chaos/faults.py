"""Inject the planned faults one by one: signals to process groups, or admin promote/rollout."""
from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path

from . import hostile
from .admin import AdminClient, AdminError
from .records import EngineView, FaultRecord, StatusSample
from .signals import SignalError, group_alive, signal_group
from .status_view import parse_status

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def settled(sample: StatusSample) -> bool:
    """One READY primary, every other engine READY (standby), no daemon in a non-READY state."""
    engines_ready = all(e.state == "READY" for e in sample.engines)
    daemons_ready = all(d.state in (None, "READY") for d in sample.daemons)
    return sample.active_count() == 1 and engines_ready and daemons_ready and len(sample.engines) >= 1


def fatal_names(sample: StatusSample | None) -> list[str]:
    """Engines and daemons the supervisor gave up on (flapping); an admin restart resets them."""
    return [v.name for v in (sample.engines + sample.daemons if sample else []) if v.state == "FATAL"]


def replaced(sample: StatusSample, fault: FaultRecord | None) -> bool:
    """Whether what `fault` hit has been replaced: a READY successor with a new pid (every engine
    for a rollout). True when there is nothing to wait for (no fault, or it was not injected)."""
    if fault is None or fault.error is not None:
        return True
    if fault.kind == "kill-supervisor":  # a new supervisor answers; the children are the same ones
        return sample.supervisor_pid is not None and sample.supervisor_pid != fault.pid
    if fault.kind == "rollout":
        before = fault.detail.get("engine_pids", {})
        return all(e.pid != before.get(e.name) and e.state == "READY" for e in sample.engines)
    if fault.name is None:
        return True
    view = sample.find(fault.name)
    resumed = "released_after_s" in fault.detail  # a SIGSTOP the supervisor missed; chaos sent SIGCONT
    if view is None or (view.pid == fault.pid and not resumed):
        return False
    return view.state == "READY" or (view.kind == "daemon" and view.state is None)


def pick_target(sample: StatusSample, role: str, rng: random.Random) -> EngineView | None:
    """The engine or daemon a fault on `role` hits (primary, standby, daemon or random)."""
    if role == "primary":
        choices = [e for e in sample.engines if e.role == "primary"]
    elif role == "standby":
        choices = [e for e in sample.engines if e.role == "standby"]
        choices = [e for e in choices if e.state == "READY"] or choices
    elif role == "daemon":
        choices = list(sample.daemons)
    else:
        choices = sample.engines + sample.daemons
    choices = [c for c in choices if c.pid is not None]
    return rng.choice(choices) if choices else None


class FaultInjector:
    """Runs `plan` (fault kinds) with at least `interval_s` between faults, each once the system
    settled and the previous victim was replaced (or `ready_timeout_s` passed); bounded by the plan
    length and the deadline."""

    def __init__(
        self,
        admin: AdminClient,
        plan: list[str],
        *,
        interval_s: float,
        ready_timeout_s: float,
        stop_release_s: float,
        seed: int = 0,
        log_dir: str = ".",
        data_url: str | None = None,
        idle_connections: int = 200,
        idle_hold_s: float = 5.0,
    ) -> None:
        self.admin = admin
        self.log_dir = log_dir  # where a supervisor restarted by chaos logs, if its stdout was no file
        self.data_url, self.idle_connections, self.idle_hold_s = data_url, idle_connections, idle_hold_s
        self.plan = plan
        self.interval_s = interval_s
        self.ready_timeout_s = ready_timeout_s
        self.stop_release_s = stop_release_s
        self.faults: list[FaultRecord] = []
        self.notes: list[str] = []
        self._rng = random.Random(seed + 1)
        self._stopped: dict[int, FaultRecord] = {}  # pgid -> the stop fault, until released or gone

    async def run(self, stop: asyncio.Event, deadline: float) -> None:
        """Inject every fault of the plan unless stopped or past the deadline."""
        last = 0.0
        for index, kind in enumerate(self.plan):
            wait = last + self.interval_s - time.time()
            if wait > 0 and await _stopped_within(stop, min(wait, deadline - time.time())):
                return
            sample, ready = await self.wait_settled(stop, deadline)
            if stop.is_set() or time.time() >= deadline:
                return
            fatal = fatal_names(sample)
            if fatal:
                self.notes.append(f"faults stopped after {len(self.faults)} of {len(self.plan)}: "
                                  f"{', '.join(fatal)} FATAL (flapping) in /status; an admin restart resets it")
                return
            fault = await self._inject(index, kind, sample)
            fault.detail["settled_before"] = ready
            self.faults.append(fault)
            last = time.time()
            self.release_stopped(older_than=self.stop_release_s)

    async def wait_settled(
        self, stop: asyncio.Event, deadline: float, timeout_s: float | None = None
    ) -> tuple[StatusSample | None, bool]:
        """Poll /status until settled(), the timeout, stop or deadline; (last sample, settled)."""
        give_up = min(deadline, time.time() + (timeout_s or self.ready_timeout_s))
        sample: StatusSample | None = None
        while True:
            try:
                sample = parse_status(await self.admin.status(), time.time())
                if settled(sample) and replaced(sample, self.faults[-1] if self.faults else None):
                    return sample, True
                if fatal_names(sample):
                    return sample, False  # will not settle by itself
            except AdminError:
                sample = None
            self.release_stopped(older_than=self.stop_release_s)
            if time.time() >= give_up or await _stopped_within(stop, 0.1):
                return sample, False

    async def _inject(self, index: int, kind: str, sample: StatusSample | None) -> FaultRecord:
        fault = FaultRecord(index=index, kind=kind, t=time.time())
        if sample is not None:
            fault.epoch_before = sample.epoch
            primary = next((e for e in sample.engines if e.role == "primary"), None)
            fault.primary_before = primary.name if primary else None
        action, _, role = kind.partition("-")
        if kind == "kill-supervisor":
            await self._kill_supervisor(fault, sample)
        elif kind in ("big-request", "idle-connections"):
            await self._hostile(fault, kind)
        elif action in SIGNALS:
            self._signal(fault, action, role, sample)
        else:
            await self._api(fault, action, sample)
        return fault

    async def _hostile(self, fault: FaultRecord, kind: str) -> None:
        if self.data_url is None:
            fault.error = "no data-plane URL to send hostile requests to"
        elif kind == "big-request":
            await hostile.big_request(fault, self.data_url)
        else:
            await hostile.idle_connections(fault, self.data_url, self.idle_connections, self.idle_hold_s)

    def _signal(self, fault: FaultRecord, action: str, role: str, sample: StatusSample | None) -> None:
        if sample is None:
            fault.error = "no /status to find a target"
            return
        target = pick_target(sample, role, self._rng)
        if target is None:
            fault.error = f"no {role} with a pid in /status"
            return
        fault.target_role = "daemon" if target.kind == "daemon" else target.role
        fault.name, fault.pid = target.name, target.pid
        fault.t = time.time()
        try:
            signal_group(target.pid, SIGNALS[action])  # type: ignore[arg-type]
        except SignalError as exc:
            fault.error = str(exc)
            return
        if action == "stop":
            self._stopped[target.pid] = fault  # type: ignore[index]

    async def _kill_supervisor(self, fault: FaultRecord, sample: StatusSample | None) -> None:
        """SIGKILL the supervisor; restarted on its held sockets (supervisor_restart.py)."""
        from .supervisor_restart import RestartError, kill_and_restart
        pid = sample.supervisor_pid if sample is not None else None
        if pid is None:
            fault.error = "no supervisor pid in /status"
            return
        fault.target_role, fault.name, fault.pid = "supervisor", "supervisor", pid
        if sample is not None:
            fault.detail["engine_pids"] = {e.name: e.pid for e in sample.engines}
        fault.t = time.time()
        try:
            fault.detail.update(await asyncio.to_thread(kill_and_restart, pid, self.admin.admin_url,
                                                        Path(self.log_dir) / f"supervisor-{fault.index}.log"))
        except RestartError as exc:
            fault.error = str(exc)

    async def _api(self, fault: FaultRecord, action: str, sample: StatusSample | None) -> None:
        path = "/admin/promote" if action == "promote" else "/admin/rollout"
        if sample is not None and action == "promote":
            old = next((e for e in sample.engines if e.role == "primary"), None)
            if old is not None:  # the planned switchover's victim: drained, then restarted as standby
                fault.target_role, fault.name, fault.pid = "primary", old.name, old.pid
        if sample is not None and action == "rollout":
            fault.detail["engine_pids"] = {e.name: e.pid for e in sample.engines}
        timeout = self.ready_timeout_s if action == "promote" else max(self.ready_timeout_s, 300.0)
        fault.t = time.time()
        try:
            code, body = await self.admin.post(path, timeout_s=timeout)
        except AdminError as exc:
            fault.error = str(exc)
            return
        finally:
            fault.t_done = time.time()
        fault.detail["http_status"] = code
        if not 200 <= code < 300:
            fault.error = f"POST {path} answered {code}: {body.strip()[:200]}"

    def release_stopped(self, older_than: float) -> None:
        """SIGCONT stopped groups the supervisor left alive for `older_than` seconds."""
        now = time.time()
        for pgid, fault in list(self._stopped.items()):
            if now - fault.t < older_than:
                continue
            del self._stopped[pgid]
            if not group_alive(pgid):
                continue
            try:
                signal_group(pgid, signal.SIGCONT)
            except SignalError:
                continue
            fault.detail["released_after_s"] = round(now - fault.t, 3)
            self.notes.append(
                f"fault {fault.index} ({fault.kind} {fault.name}): group {pgid} was still stopped "
                f"(not fenced by the supervisor) {now - fault.t:.1f} s later; chaos sent SIGCONT"
            )


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Wait up to `seconds` for `stop`; True if it was set."""
    if seconds <= 0:
        return stop.is_set()
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
        return True
    except asyncio.TimeoutError:
        return False
