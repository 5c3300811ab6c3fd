"""Engine lifecycle: start (spawn server, direct, or external command), readiness (canary vs golden),
control-channel messages, exits (decoded; boot errors stop), backoff restarts, drain/stop."""
from __future__ import annotations

import asyncio
import json
import logging
import shlex
import signal
import time
from typing import Any

from daemon.framing import FrameError
from engines.config import BOOT_ERROR_EXIT, EngineConfig
from engines.loopback import free_port
from supervisor.config import template_fields
from supervisor.canary import compare, is_listening, run_canary
from supervisor.control import EngineMessage
from supervisor.exitstatus import describe_returncode
from supervisor.launch import PopenHandle, child_env, group_alive, kill_group, python_argv, rotate_log
from supervisor.limits import engine_limits
from supervisor.logtail import last_line
from supervisor.pidwatch import watch_exit
from supervisor.slots import EngineSlot, served_count
from supervisor.states import RUNNING, Role, State

log = logging.getLogger("understudy")

READY_POLL_S = 0.05
KEEP_LOGS = 20  # per slot, the logs of the last incarnations (runtime_dir is often a tmpfs)
SPAWN_SERVER_WAIT_S = 30.0  # a start waits this long for a spawn server being restarted, then execs directly


ENGINE_STATES = {"ATTACHING": State.ATTACHING, "WARMING": State.WARMING}
HEARTBEAT_FIELDS = ("steps", "running", "waiting", "served", "kv_blocks_used", "kv_blocks_total",
                    "prefix_queried_tokens", "prefix_hit_tokens", "preemptions", "generated_tokens")


class EngineOps:
    """Mixin of Supervisor (see arbiter.py for the attributes it uses)."""

    # ------------------------------------------------------------------ start
    def start_engine(self, slot: EngineSlot) -> None:
        """New incarnation of ``slot`` (client mode), as standby unless nobody serves."""
        if self.stopping:
            return
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        slot.retry_at = None
        slot.incarnation += 1
        old_log = self.log_path(f"{slot.name}-{slot.incarnation - KEEP_LOGS}")
        old_log.unlink(missing_ok=True)
        old_log.with_name(old_log.name + ".1").unlink(missing_ok=True)  # its previous run's (rotate_log)
        slot.port = free_port()
        slot.url = f"http://127.0.0.1:{slot.port}"
        slot.stop_requested = slot.restart_after_stop = False
        slot.last_heartbeat, slot.heartbeat, slot.probe_failures = None, {}, 0
        slot.weights_source, slot.phases, slot.engine_state, slot.startup_counted = None, {}, "", False
        slot.role = Role.STANDBY
        slot.started_at = time.monotonic()
        slot.pid = None
        self.transition(slot, State.STARTING, f"incarnation {slot.incarnation}")
        self._spawn(self._launch_engine(slot, slot.incarnation), f"launch-{slot.name}")

    async def _launch_engine(self, slot: EngineSlot, inc: int) -> None:
        try:
            handle = await self._start_process(slot)
        except Exception as e:  # spawn refused, bad template, ...: a failure of this slot
            log.error("%s: could not start: %s", slot.name, e)
            if slot.incarnation == inc and slot.state in RUNNING:
                self.transition(slot, State.FAILED, f"start failed: {e}")
                self.schedule_restart(slot)
            return
        if slot.incarnation != inc:  # a newer start owns the slot: never let this one's pid overwrite it
            log.warning("%s: incarnation %d started after being superseded; killing pid %d", slot.name, inc, handle.pid)
            kill_group(handle.pid)
            return
        slot.proc, slot.pid = handle, handle.pid
        slot.cancel_watch = watch_exit(self.loop, handle.pid, lambda pid: self.on_engine_exit(slot, inc, pid))
        log.info("%s: pid %d, incarnation %d, %s", slot.name, handle.pid, inc, slot.url)
        if slot.state == State.DRAINING or self.stopping:
            kill_group(handle.pid, signal.SIGTERM if not self.stopping else signal.SIGKILL)
            return
        self.write_state()
        slot.ready_task = self._spawn(self._await_ready(slot, inc), f"ready-{slot.name}")

    async def _start_process(self, slot: EngineSlot):
        log_path = self.log_path(f"{slot.name}-{slot.incarnation}")
        if self.external:
            ext = self.cfg.engines.external
            fields = template_fields(slot.port, str(self.model_path), slot.name, self.model_name,
                                     self.cfg.resolved_gpu_ids())
            argv = [a.format(**fields) for a in shlex.split(ext.command)]
            slot.url = ext.url.format(**fields).rstrip("/")
            return PopenHandle(argv, log_path, {**child_env(), **ext.env})
        ec = self.engine_config(slot)
        if self.cfg.engines.spawn == "server":
            client = await self.wait_spawn_client(SPAWN_SERVER_WAIT_S)
            if client is not None:
                rotate_log(log_path)
                try:
                    return await client.spawn(ec.model_dump(), log_path)
                except (OSError, FrameError) as e:  # it went away meanwhile (rollout, crash): not this slot's fault
                    log.warning("%s: spawn server unavailable (%s); starting the engine directly", slot.name, e)
            else:
                log.warning("%s: no spawn server within %gs; starting the engine directly", slot.name,
                            SPAWN_SERVER_WAIT_S)
        return PopenHandle(python_argv("engines", "--config-json", ec.model_dump_json()), log_path, child_env())

    async def wait_spawn_client(self, timeout_s: float):
        """The spawn server's client, waiting while one is being (re)started (rollout, crash)."""
        deadline = time.monotonic() + timeout_s
        while self.spawn_client is None and time.monotonic() < deadline and not self.stopping:
            await asyncio.sleep(0.05)
        return self.spawn_client

    def engine_config(self, slot: EngineSlot) -> EngineConfig:
        e, m = self.cfg.engines, self.cfg.model
        return EngineConfig(
            name=slot.name, model_path=str(self.model_path), tp_size=m.tp_size, dtype=m.dtype,
            device=self.device, gpu_ids=self.cfg.resolved_gpu_ids() if self.device == "cuda" else [],
            host="127.0.0.1", port=slot.port, weight_cache_mode=e.weight_cache_mode, runtime_dir=str(self.rd),
            control_endpoint=self.control.endpoint, incarnation=slot.incarnation, kv_cache_bytes=e.kv_cache_bytes,
            max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len,
            max_num_batched_tokens=e.max_num_batched_tokens, kv_block_size=e.kv_block_size,
            prefix_caching=e.prefix_caching, cuda_graphs=e.cuda_graphs,
            fused_kernels=e.fused_kernels, heartbeat_interval_s=e.heartbeat_interval_s,
            dist_port=free_port() if m.tp_size > 1 else 0,
            served_model_name=self.model_name, **engine_limits(self.cfg))

    # ------------------------------------------------------------------ readiness
    async def _await_ready(self, slot: EngineSlot, inc: int) -> None:
        """Wait for the HTTP server, then the canary must match the golden answer."""
        while not await is_listening(self.http, slot.url):
            await asyncio.sleep(READY_POLL_S)
            if slot.incarnation != inc or slot.state not in RUNNING:
                return
        if slot.state == State.STARTING:
            self.transition(slot, State.WARMING, "HTTP up")
        unanswered = 0
        while slot.incarnation == inc and slot.state in (State.ATTACHING, State.WARMING, State.STARTING):
            res = await run_canary(self.http, slot.url, self.model_name, self.cfg.canary.prompt,
                                   self.cfg.canary.max_tokens, self.cfg.failover.probe_timeout_s)
            if slot.incarnation != inc or slot.state not in RUNNING:
                return
            if res.broken:  # it answered, with non-finite logits: never promoted
                log.error("%s: canary failed: %s; never promoted", slot.name, res.error)
                self.events.publish({"type": "canary_mismatch", "engine": slot.name, "reason": res.error,
                                     "fingerprint": self.fingerprint, "weights_source": slot.weights_source})
                self.fail_engine(slot, f"canary: {res.error}")
                return
            if not res.ok:  # the engine is still starting: say so once, then only at debug level
                (log.info if not unanswered else log.debug)("%s: canary not answered yet: %s", slot.name, res.error)
                unanswered += 1
                await asyncio.sleep(0.2)
                continue
            await self._fetch_startup(slot)  # the weights' source, for the golden's provenance
            golden = self.golden.record(self.fingerprint, res, slot.name, self.weights_provenance(slot))
            mismatch = compare(golden, res)
            if mismatch:
                await self._fetch_startup(slot)
                log.error("%s: %s (weights %s); never promoted", slot.name, mismatch, slot.weights_source)
                self.events.publish({"type": "canary_mismatch", "engine": slot.name, "reason": mismatch,
                                     "fingerprint": self.fingerprint, "weights_source": slot.weights_source})
                self.fail_engine(slot, mismatch)
                return
            await self._fetch_startup(slot)
            self.on_engine_ready(slot)
            return

    def weights_provenance(self, slot: EngineSlot) -> dict[str, Any]:
        """Whether the engine's weights were checked finite, and their content digest: a cache hit
        maps the daemons' arenas (each checked when loaded); a disk load is checked by the engine
        itself (engines/weights.py: it exits 3 otherwise); external engines are not checked."""
        src, digest = slot.weights_source or "", None
        if src.startswith("cache_hit"):
            finite = bool(self.daemons) and all(d.weights_finite is True for d in self.daemons)
            digest = next((d.fingerprint.get("content_digest") for d in self.daemons if d.fingerprint), None)
        else:
            finite = True if src.startswith("disk") and not self.external else None
        return {"weights_source": src or None, "weights_finite": finite, "content_digest": digest}

    async def _fetch_startup(self, slot: EngineSlot) -> None:
        """Startup phases and weight source from GET /startup, if the control channel did not bring them."""
        if self.external or slot.weights_source is not None:
            return
        try:
            status, body = await self.http.fetch("GET", slot.url, "/startup", timeout_s=2.0)
            if status == 200:
                self._record_startup(slot, json.loads(body))
        except Exception as e:  # startup info is a report, not a readiness condition
            log.debug("%s: /startup unavailable: %s", slot.name, e)

    def on_engine_ready(self, slot: EngineSlot) -> None:
        now = time.monotonic()
        slot.policy.record_success()
        slot.crash_loop = False
        slot.last_progress = slot.last_probe = now
        slot.probe_served = served_count(slot)
        self.transition(slot, State.READY, f"canary passed in {now - slot.started_at:.2f}s after spawn"
                        + (f", weights {slot.weights_source}" if slot.weights_source else ""))
        if slot.down_since is not None:
            secs = now - slot.down_since
            slot.down_since = None
            self.metrics.recovery_seconds.observe(secs)
            self.events.publish({"type": "recovered", "engine": slot.name, "incarnation": slot.incarnation,
                                 "seconds": secs, "weights_source": slot.weights_source})
        if self.table.primary is None and not self.stopping:
            reason, t0, old = self.pending_failover or ("boot", now, "")
            self.pending_failover = None
            self.promote(slot, reason, t0, old)
        self.refresh_gauges()

    # ------------------------------------------------------------------ messages
    def on_engine_message(self, msg: EngineMessage) -> None:
        slot = self.engines.get(msg.engine)
        if slot is None or msg.incarnation != slot.incarnation:
            return
        now = time.monotonic()
        if msg.type == "heartbeat":
            slot.last_heartbeat = now
            hb = {k: msg.get(k) for k in HEARTBEAT_FIELDS}
            if (hb.get("served"), hb.get("steps")) != (slot.heartbeat.get("served"), slot.heartbeat.get("steps")):
                slot.last_progress = now
            self.metrics.record_heartbeat(slot.name, hb, slot.heartbeat)
            slot.heartbeat = hb
        elif msg.type == "state":
            self.watchdog_gate.progress(now)
            st = str(msg.get("state", ""))
            slot.engine_state = st
            target = ENGINE_STATES.get(st)
            if target is not None and slot.state in (State.STARTING, State.ATTACHING) and slot.state != target:
                self.transition(slot, target, "reported by engine")
        elif msg.type == "phase":
            self.watchdog_gate.progress(now)
            slot.phases[str(msg.get("phase"))] = float(msg.get("seconds") or 0.0)
            if msg.get("source"):
                slot.weights_source = str(msg.get("source"))
        elif msg.type == "startup":
            self._record_startup(slot, {"phases": msg.get("phases") or {}, "weights_source": msg.get("weights_source")})

    def _record_startup(self, slot: EngineSlot, data: dict[str, Any]) -> None:
        if slot.startup_counted:
            return
        slot.phases = {str(k): float(v) for k, v in (data.get("phases") or {}).items()}
        slot.weights_source = data.get("weights_source") or slot.weights_source
        slot.startup_counted = True
        for phase, secs in slot.phases.items():
            self.metrics.startup_phase.labels(phase=phase).observe(secs)
        if slot.weights_source:
            self.metrics.count_weights_source(slot.weights_source)
            if slot.weights_source not in ("cache_hit", "disk:off"):
                log.warning("%s: weights from %s", slot.name, slot.weights_source)

    # ------------------------------------------------------------------ failure and exit
    def on_engine_exit(self, slot: EngineSlot, inc: int, pid: int) -> None:
        """pidfd event: fence the group, fail over if it served, restart or stop."""
        if slot.incarnation != inc or slot.pid != pid:
            return
        now = time.monotonic()
        kill_group(pid)  # fence: the other ranks of this engine die with it
        proc, slot.pid, slot.cancel_watch = slot.proc, None, None
        self.pending_reap.add(pid)
        if slot.ready_task is not None:
            slot.ready_task.cancel()
        expected = slot.stop_requested or self.stopping
        serving = self.table.primary is not None and self.table.primary.name == slot.name \
            and self.table.primary.epoch == self.epoch and slot.role == Role.PRIMARY
        reason = slot.reason if slot.state == State.FAILED else ("stopped" if expected else "exit")
        if not expected:
            slot.down_since = slot.down_since or now
        if serving and not self.stopping:
            self.failover(slot, reason.split(":")[0], slot.down_since or now)
        if expected:
            if slot.state in RUNNING and slot.state != State.DRAINING:
                self.transition(slot, State.DRAINING, "stop requested")
            self.transition(slot, State.STOPPED, "stopped on request")
        elif slot.state in RUNNING:
            self.transition(slot, State.EXITED, "process exited without being asked to")
        slot.role = Role.STANDBY  # it comes back as a standby
        self._spawn(self._finish_exit(slot, inc, pid, proc, expected), f"exit-{slot.name}")

    async def _finish_exit(self, slot: EngineSlot, inc: int, pid: int, proc, expected: bool) -> None:
        """Decode the exit status, then restart (backoff), stop, or go FATAL on a boot error."""
        try:
            rc = await proc.returncode() if proc is not None else None
        finally:
            self.pending_reap.discard(pid)
        if self.cfg.model.tp_size > 1:  # the other ranks were SIGKILLed: let them release GPU memory first
            await self._wait_group_gone(pid, 10.0)
        text = describe_returncode(rc)
        if rc == 0 and not expected:
            text += " (not requested: counted as a failure)"
        logf = self.log_path(f"{slot.name}-{inc}")
        (log.info if expected else log.warning)("%s: pid %d (incarnation %d) %s%s", slot.name, pid, inc, text,
                                                "" if expected else f"; log: {logf}")
        if slot.incarnation != inc:
            return
        slot.last_exit = text
        if expected:
            if slot.restart_after_stop and not self.stopping and slot.state == State.STOPPED:
                self.start_engine(slot)
            self.write_state()
            return
        if slot.state == State.EXITED:
            slot.reason = text
        slot.log_line = last_line(logf)
        if rc == BOOT_ERROR_EXIT and not self.external and not (self.epoch > 0 and self.last_standing(slot)):
            self.transition(slot, State.FATAL, f"boot error ({text}): restarting will not help; "
                            f"{slot.log_line}")
            self.check_all_fatal()
            return
        self.schedule_restart(slot)  # a boot error of the last engine of a node that served: retried

    async def _wait_group_gone(self, pgid: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while await asyncio.to_thread(group_alive, pgid):
            if time.monotonic() > deadline:
                log.warning("process group %d still alive %.0fs after SIGKILL", pgid, timeout_s)
                return
            kill_group(pgid)
            await asyncio.sleep(0.05)

    def schedule_restart(self, slot: EngineSlot) -> None:
        """Backoff restart. A slot that flaps goes FATAL, unless it is the last engine standing:
        that one is retried with the capped backoff forever (the node never gives up serving)."""
        if self.stopping:
            return
        delay = slot.policy.record_failure()
        n, w = len(slot.policy.failures), self.cfg.failover.flap_window_s
        slot.crash_loop = False
        if slot.policy.flapping and not self.last_standing(slot):
            self.transition(slot, State.FATAL, f"flapping: {n} failures within {w:g}s "
                            f"(last: {slot.reason}); `understudy restart {slot.name}` resets it")
            self.events.publish({"type": "fatal", "engine": slot.name, "reason": slot.reason})
            return
        if slot.policy.flapping:
            slot.crash_loop = True
            why = (f"crash loop ({n} failures within {w:g}s), last engine standing: retried with backoff "
                   f"up to {self.cfg.failover.backoff_max_s:g}s; restart in {delay:.2f}s (last: {slot.reason})")
            (log.warning if slot.policy.consecutive <= slot.policy.max_failures else log.info)("%s: %s", slot.name, why)
        else:
            why = f"restart in {delay:.2f}s (last: {slot.reason})"
        slot.retry_at = time.monotonic() + delay  # before the transition: state.json and STATUS show it
        self.transition(slot, State.BACKOFF, why)
        slot.timer = self.loop.call_later(delay, self._backoff_done, slot)

    def last_standing(self, slot: EngineSlot) -> bool:
        """Every other engine slot is FATAL: nothing else would ever serve if this one stopped."""
        return all(o.state == State.FATAL for o in self.engines.values() if o is not slot)

    def _backoff_done(self, slot: EngineSlot) -> None:
        slot.timer = None
        slot.retry_at = None
        if slot.state == State.BACKOFF and not self.stopping:
            self.start_engine(slot)

    def stop_engine(self, slot: EngineSlot, restart: bool = False) -> None:
        """Drain (finish in-flight, exit 0), then STOPPED, or a fresh start if ``restart``."""
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        slot.retry_at = None
        if slot.state not in RUNNING or (slot.pid is None and slot.state != State.STARTING):
            if slot.state != State.STOPPED:
                self.transition(slot, State.STOPPED, "stopped on request")
            if restart:
                slot.policy.reset()
                self.start_engine(slot)
            return
        slot.stop_requested, slot.restart_after_stop = True, restart
        if slot.state != State.DRAINING:
            self.transition(slot, State.DRAINING, "drain requested")
        if slot.pid is None:
            return  # still launching: _launch_engine sees DRAINING and stops it
        if self.external or slot.last_heartbeat is None:  # not on the control channel: SIGTERM
            kill_group(slot.pid, signal.SIGTERM)
        else:
            self._spawn(self._send_drain(slot), f"drain-{slot.name}")

    async def _send_drain(self, slot: EngineSlot) -> None:
        pid = slot.pid
        if not await self.control.send(slot.name, slot.incarnation, {"cmd": "drain"}) and pid:
            kill_group(pid, signal.SIGTERM)

    def check_all_fatal(self) -> None:
        """Boot errors stop instead of looping: every slot FATAL from a boot error before anything
        served = halt (a flapping slot stays FATAL in status instead, for an admin to reset)."""
        if self.epoch == 0 and all(s.state == State.FATAL and s.reason.startswith("boot error")
                                   for s in self.engines.values()):
            reasons = {s.reason.split("; ", 1)[-1] for s in self.engines.values()}
            names = ", ".join(self.engines)
            self.halt(f"no engine could start ({names}, boot error exit code {BOOT_ERROR_EXIT}): "
                      f"{' | '.join(sorted(reasons))}")
