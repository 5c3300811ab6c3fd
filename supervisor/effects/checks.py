"""Probe: one check of a child, its answer as an event. An engine's readiness (HTTP up, the canary
through its real HTTP path, compared with the golden answer, which the first engine to pass records)
and health (an external engine's own /health where it has one, then the canary again; an external engine's
model id and continuation paths are learned before READY: supervisor/effects/abilities.py); a daemon's status while it loads and its pings once READY (an external engine's daemon: its
readiness check, supervisor/effects/ready_checks.py); a new spawn server's ping."""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import time
from typing import Any

from daemon import framing
from supervisor.config import UnderstudyConfig
from supervisor.core.actions import Probe
from supervisor.core.events import DaemonAnswered, Event, HealthChecked, Pinged, ReadyChecked
from supervisor.effects.abilities import ModelIdError, NotAnswered, learn_abilities, reported_model_id
from supervisor.effects.canary import GoldenStore, compare, is_listening, run_canary, weights_provenance
from supervisor.router.abilities import Abilities
from supervisor.effects.launcher import log_path
from supervisor.effects.processes import SpawnClient
from supervisor.effects.ready_checks import not_ready
from supervisor.router.upstream import Client, UpstreamError

log = logging.getLogger("understudy")

STATUS_TIMEOUT_S = 5.0
PING_TIMEOUT_S = 2.0
STARTUP_TIMEOUT_S = 2.0


def daemon_status(path: str, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """One ``status`` request on a daemon socket (blocking; run in a thread)."""
    return framing.request(path, {"op": "status"}, timeout_s)


def out_of_descriptors() -> bool:
    """Whether this process cannot open a file now (EMFILE/ENFILE): a probe that failed meanwhile
    says nothing about its target (asked only after a failure)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        return False
    except OSError as e:
        return e.errno in (errno.EMFILE, errno.ENFILE)


class Checks:
    def __init__(self, cfg: UnderstudyConfig, model_name: str, http: Client, golden: GoldenStore, fingerprint: str,
                 spawn_client: SpawnClient) -> None:
        self.cfg, self.model_name, self.http = cfg, model_name, http
        self.golden, self.fingerprint = golden, fingerprint
        self.external = cfg.engines.kind == "external"
        self.learned: dict[str, Abilities] = {}  # an external engine's URL -> what it can do (read at promotion)
        self.spawn_ping = SpawnClient(spawn_client.path, PING_TIMEOUT_S)

    async def probe(self, a: Probe) -> Event:
        if a.what == "ready":
            return await self.ready(a)
        if a.what == "health":
            try:
                problem = await self._own_health(a.target)
                if problem is None:
                    res = await self._canary(a.target, self._model_of(a.target))
                    golden = self.golden.get(self.fingerprint)
                    problem = res.error if not res.ok else (compare(golden, res) if golden else None)
            except OSError as e:
                return HealthChecked(a.name, a.incarnation, f"{type(e).__name__}: {e}", out_of_descriptors())
            return HealthChecked(a.name, a.incarnation, problem, problem is not None and out_of_descriptors())
        if a.what == "up":  # an external engine's daemon: its readiness check (engines.external.daemon_ready)
            log_file = log_path(self.cfg.resolved_runtime_dir(), a.kind, a.name, a.incarnation)
            problem = await not_ready(a.target, log_file)
            return Pinged(a.name, a.incarnation, problem is None, problem or "")
        if a.what == "status":
            try:
                return DaemonAnswered(a.name, a.incarnation, await asyncio.to_thread(daemon_status, a.target))
            except (OSError, ValueError) as e:
                return DaemonAnswered(a.name, a.incarnation, None, str(e))
        try:
            if a.kind == "daemon":
                await asyncio.to_thread(daemon_status, a.target, PING_TIMEOUT_S)
                return Pinged(a.name, a.incarnation, True)
            reply = await self.spawn_ping.call({"op": "ping"})
            return Pinged(a.name, a.incarnation, bool(reply.get("ok")), "" if reply.get("ok") else str(reply))
        except (OSError, ValueError, ImportError) as e:
            return Pinged(a.name, a.incarnation, False, str(e), out_of_descriptors())

    async def ready(self, a: Probe) -> ReadyChecked:
        """HTTP up, then the canary must match the golden answer (recorded by the first to pass)."""
        if not await is_listening(self.http, a.target):
            return ReadyChecked(a.name, a.incarnation, listening=False)
        model = self.model_name
        if self.external:  # the id the engine reports, not a hand-set one
            try:
                got = await reported_model_id(self.http, a.target, self.cfg.model.name, self.cfg.failover.probe_timeout_s)
            except NotAnswered as e:
                return ReadyChecked(a.name, a.incarnation, listening=True, error=str(e))
            except ModelIdError as e:
                return ReadyChecked(a.name, a.incarnation, listening=True, broken=True, error=str(e))
            if got.id is None:
                log.warning("%s: %s; requests name the model %r (model.name, else the folder's name)", a.name,
                            got.note, model)
            model = got.id or model
        t0 = time.monotonic()
        res = await self._canary(a.target, model)
        canary_s = time.monotonic() - t0
        if not res.ok:
            return ReadyChecked(a.name, a.incarnation, listening=True, broken=res.broken, error=res.error or "")
        if self.external:
            res.model_id = model
        facts = a.detail
        startup = None
        if facts.get("weights_source") is None and not facts.get("external"):
            startup = await self._startup(a.target)  # the weights' source, for the golden's provenance
        source = (startup or {}).get("weights_source") or facts.get("weights_source")
        golden = self.golden.record(self.fingerprint, res, a.name, weights_provenance(facts, source))
        mismatch = compare(golden, res)
        if self.external and mismatch is None:
            ab = await learn_abilities(self.http, a.target, model, self.cfg.canary.prompt,
                                       self.cfg.failover.probe_timeout_s)
            self.learned[a.target] = ab
            log.info("%s: %s", a.name, ab.brief())
        return ReadyChecked(a.name, a.incarnation, listening=True, answered=True, mismatch=mismatch,
                            canary_s=canary_s, startup=startup)

    def abilities_of(self, url: str) -> Abilities | None:
        """What the router may send the engine at ``url``: None for ours; for an external one, what it was
        found to take at READY, or (an engine re-adopted after a supervisor restart, not probed by this
        supervisor) the model id the node recorded and a replay by text of completions only."""
        if not self.external:
            return None
        if (ab := self.learned.get(url)) is None:
            golden = self.golden.get(self.fingerprint) or {}
            ab = self.learned[url] = Abilities(model_id=golden.get("model_id") or self.model_name)
            log.warning("engine at %s was not probed by this supervisor: %s", url, ab.brief())
        return ab

    def _model_of(self, url: str) -> str:
        ab = self.learned.get(url)
        return ab.model_id if ab is not None else self.model_name

    async def _own_health(self, url: str) -> str | None:
        """An external engine's own /health: a problem unless it answers 200 (or has no such route)."""
        if not self.external:
            return None
        try:
            status, body = await self.http.fetch("GET", url, "/health", timeout_s=self.cfg.failover.probe_timeout_s)
        except UpstreamError as e:
            return f"/health: {type(e).__name__}: {e}".rstrip(": ")
        if status in (200, 404, 405):
            return None
        return f"/health answered HTTP {status}: {body[:120].decode(errors='replace')!r}"

    async def _canary(self, url: str, model: str):  # noqa: ANN202
        c = self.cfg
        return await run_canary(self.http, url, model, c.canary.prompt, c.canary.max_tokens,
                                c.failover.probe_timeout_s)

    async def _startup(self, url: str) -> dict[str, Any] | None:
        """GET /startup: phases and weights source (when the control channel did not bring them)."""
        try:
            status, body = await self.http.fetch("GET", url, "/startup", timeout_s=STARTUP_TIMEOUT_S)
            return json.loads(body) if status == 200 else None
        except Exception as e:  # noqa: BLE001 (startup info is a report, not a readiness condition)
            log.debug("%s: /startup unavailable: %s", url, e)
            return None
