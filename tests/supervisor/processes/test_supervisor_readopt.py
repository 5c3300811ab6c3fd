"""Supervisor restart without dropping the node (real processes, CPU, tiny model): the test holds the
listening sockets as systemd's understudy.socket would, SIGKILLs the supervisor under ~20 req/s,
starts a new one on the same sockets, and checks that it re-adopts the live daemon, spawn server and
engines (same pids, roles, epoch), that no connection is refused, and that only requests in flight
inside the dead process are lost."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil

from harness.handover import listening

from harness.load import OpenLoad

from harness.node import Harness

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 1024}}
failover: {{heartbeat_timeout_s: 3, probe_interval_s: 1, probe_timeout_s: 5, hold_timeout_s: 20,
           backoff_base_s: 0.1, backoff_max_s: 1, drain_timeout_s: 10, stop_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""

RATE = 20.0  # requests per second, each on a new connection


class Restarted:
    """A supervisor on listening sockets the test holds (as systemd's understudy.socket would), and
    the one that replaces it after a SIGKILL (``restart``); ``close`` stops whatever is left."""

    def __init__(self, tmp_path, tiny_model) -> None:  # noqa: ANN001
        self.router, self.admin = listening(), listening()
        self.held = {"router": self.router, "admin": self.admin}
        self.rt = tmp_path / "rt"
        self.cfg = CONFIG.format(rt=self.rt, model=tiny_model)
        self.work = tmp_path
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        self.first = Harness(tmp_path / "a", self.cfg, notify=False, held=self.held)
        self.second: Harness | None = None

    def restart(self) -> Harness:
        """The second supervisor, as systemd starts it again."""
        self.second = Harness(self.work / "b", self.cfg, notify=False, held=self.held)
        return self.second

    def close(self) -> None:
        if self.second is not None:
            self.second.stop()
        self.first.stop()
        if self.first.proc.returncode == -signal.SIGKILL and self.second is None:
            from supervisor.effects.stale import check_and_clean
            check_and_clean(self.rt)
        self.router.close()
        self.admin.close()


def test_sigkill_supervisor_restarts_on_the_same_socket_and_readopts_everything(tmp_path, tiny_model):
    pair = Restarted(tmp_path, tiny_model)
    url = "http://127.0.0.1:%d" % pair.router.getsockname()[1]
    first = pair.first
    try:
        first.wait_booted()
        assert first.router_url == url  # the handed-over socket, not a new one
        before = first.wait_all_ready(120)
        assert first.admin("POST", "/admin/drain").status_code == 200  # an operator's drain outlives the crash
        load = OpenLoad(url, tiny_model.name, RATE).start()
        time.sleep(2.0)
        long = threading.Thread(target=load.one, args=(900,))  # in flight in the process killed (120 tokens
        # could end within the 0.1 s below)
        t_long = time.monotonic()
        long.start()
        time.sleep(0.1)
        assert long.is_alive()
        t_kill, wall_kill = time.monotonic(), time.time()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        second = pair.restart()  # as systemd restarts it
        time.sleep(4.0)
        load.stop()
        long.join(60)
        second.wait_booted(30)
        after = second.wait_all_ready(30)

        # 0 engine restarts: the same processes, incarnations, roles and epoch
        def ident(st):
            return ({e["name"]: (e["pid"], e["incarnation"], e["role"]) for e in st["engines"]},
                    {d["name"]: d["pid"] for d in st["daemons"]}, st["spawn_server"], st["epoch"], st["primary"])
        assert ident(after) == ident(before), (json.dumps(before)[:2000], json.dumps(after)[:2000])
        assert after["pid"] == second.proc.pid != before["pid"]
        assert after["drained"] and "node still drained" in second.log.read_text()
        assert second.admin("POST", "/admin/undrain").status_code == 200
        text = second.log.read_text()  # (the "adopted" event goes out before a subscriber can join)
        line = next(ln for ln in text.splitlines() if "re-adopted from the previous supervisor" in ln)
        for name in ("daemon-rank0", "spawn-server", "a", "b"):
            assert f"{name} (pid " in line, line
        assert "stopped, not adopted" not in text and "-> STARTING: incarnation" not in text

        res = sorted(load.results)
        refused = [r for r in res if r[2] == "refused"]
        failed = [r for r in res if r[2] != "ok"]
        assert not refused, refused
        # only requests in flight inside the dead process are lost: every failure began before the kill
        # (and the long one, in flight for sure, is one of them: losses are seen and counted)
        assert all(start < t_kill for start, _, _ in failed), (t_kill, failed)
        assert any(t_long <= start < t_kill for start, _, _ in failed), (t_long, t_kill, failed)
        later = [end for start, end, out in res if out == "ok" and end > t_kill]
        assert later, res[-10:]
        gap = min(later) - t_kill  # SIGKILL -> first answer served by the new supervisor
        stamp = line.split(" understudy ")[0]
        adopted = time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(stamp[-3:]) / 1000
        print(f"\nreadopt: {len(res)} requests at {RATE:g}/s, {len(failed)} lost (in flight in the killed "
              f"supervisor), 0 refused, serving again {gap:.2f} s after SIGKILL (children "
              f"re-adopted at +{adopted - wall_kill:.2f} s)")
        # ... in flight at the kill: each began before it and ended after it (a request that ended
        # before the kill was served by the first supervisor, whole)
        assert all(start < t_kill <= end for start, end, _ in failed), (t_kill, failed)
        assert all(out == "ok" for _, end, out in res if end < t_kill), [r for r in res if r[1] < t_kill][-5:]
        # (the 2 s target is measured by `understudy bench supervisor-restart`, not asserted here: on a
        # shared 2-core box the new interpreter's start alone varies from 1.4 to 7 s)

        # the normal stop (SIGTERM) still stops every child, adopted or not
        pids = [p for p, _, _ in ident(after)[0].values()] + list(ident(after)[1].values()) \
            + [after["spawn_server"]["pid"]]
        assert second.stop() == 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)]
    finally:
        pair.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_chaos_kill_supervisor_fault_restarts_it_on_its_own_sockets(tmp_path, tiny_model):
    """The chaos fault `kill-supervisor` on a supervisor that bound its ports itself: chaos takes
    copies of its listening sockets (pidfd_getfd), SIGKILLs it and starts it again on them."""
    import asyncio

    from harness.chaos.admin import AdminClient
    from harness.chaos.faults import FaultInjector, replaced, settled
    from harness.chaos.status_view import parse_status

    h = Harness(tmp_path, CONFIG.format(rt=tmp_path / "rt", model=tiny_model), notify=False)
    new_pid = None
    try:
        h.wait_booted()
        before = h.wait_all_ready(120)
        load = OpenLoad(h.router_url, tiny_model.name, RATE).start()
        time.sleep(1.0)

        async def inject():
            admin = AdminClient(h.admin_url, h.token)
            inj = FaultInjector(admin, ["kill-supervisor"], interval_s=0, ready_timeout_s=30, stop_release_s=30,
                                log_dir=str(tmp_path / "chaos"))
            sample = parse_status(await admin.status(), time.time())
            fault = await inj._inject(0, "kill-supervisor", sample)
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    s = parse_status(await admin.status(), time.time())
                    if settled(s) and replaced(s, fault):
                        break
                except Exception:  # noqa: BLE001 (the admin port answers once the new one runs)
                    pass
                await asyncio.sleep(0.1)
            await admin.close()
            return fault, s

        fault, after_sample = asyncio.run(inject())
        t_kill = fault.t
        time.sleep(2.0)
        load.stop()
        assert fault.error is None, fault.error
        assert fault.pid == before["pid"] and fault.detail["restarted_by"] == "chaos"
        new_pid = fault.detail["new_pid"]
        after = h.status()
        assert after["pid"] == new_pid == after_sample.supervisor_pid
        assert {e["name"]: e["pid"] for e in after["engines"]} == fault.detail["engine_pids"]  # 0 engine restarts
        assert after["epoch"] == before["epoch"] and after["primary"] == before["primary"]
        res = load.results
        assert not [r for r in res if r[2] == "refused"], res
        wall_offset = time.time() - time.monotonic()
        lost = [r for r in res if r[2] != "ok"]
        # in flight at the kill: begun before SIGKILL was sent (what the new supervisor took from the
        # held socket is never lost) and ended after the kill began
        killed_at = fault.detail["killed_at"]
        assert all(start + wall_offset < killed_at and end + wall_offset >= t_kill for start, end, _ in lost), \
            (t_kill, killed_at, lost)
        print(f"\nchaos kill-supervisor: {len(res)} requests, {len(lost)} lost, down {fault.detail['down_s']} s")
    finally:
        if new_pid is not None:  # the restarted supervisor is chaos's child, not the harness's
            os.kill(new_pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _alive(new_pid):
                time.sleep(0.1)
        h.stop()
        if h.proc.returncode == -signal.SIGKILL and new_pid is None:
            from supervisor.effects.stale import check_and_clean
            check_and_clean(tmp_path / "rt")


def test_bench_supervisor_restart_reports_the_contract(tmp_path, tiny_model, capsys):
    """`understudy bench supervisor-restart`: one kill, JSON out; 0 refused, no child restarted."""
    from supervisor.cli import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"device: cpu\ncache_dir: {tmp_path / 'cache'}\nmodel: {{path: {tiny_model}}}\n"
                   "engines: {kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}\n")
    rc = main(["bench", "supervisor-restart", "-c", str(cfg), "--runs", "1", "--settle", "1", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert res["refused"] == 0 and res["children_restarted"] == 0, res
    assert res["failed_requests"] == res["lost"] and rc == 0, res
    (kill,) = res["per_kill"]
    assert kill["adopted_s"] > 0 and kill["serving_again_s"] > 0, kill  # (how fast: the bench's report)


def test_an_engine_whose_spawn_was_in_flight_is_stopped_not_orphaned(tmp_path, tiny_model):
    """A child of the spawn server that no record names (the supervisor died before the spawn's
    answer) is stopped by the next supervisor; the recorded children are still re-adopted."""
    from wire.engine_config import EngineConfig
    from engines.process.spawn_client import SpawnClient
    rt = tmp_path / "rt"
    h = Harness(tmp_path, CONFIG.format(rt=rt, model=tiny_model), notify=False)
    second = None
    try:
        h.wait_booted()
        before = h.wait_all_ready(120)
        cfg = EngineConfig(name="stray", model_path=str(tiny_model), port=0, runtime_dir=str(rt),
                           weight_cache_mode="client", kv_cache_bytes=4194304, max_num_seqs=8, max_model_len=128)
        with SpawnClient(str(rt / "spawn.sock")) as sc:
            stray = sc.spawn(cfg, str(tmp_path / "stray.log"))
        assert _alive(stray)
        h.proc.kill()
        h.proc.wait()
        (tmp_path / "b").mkdir()
        second = Harness(tmp_path / "b", CONFIG.format(rt=rt, model=tiny_model), notify=False)
        second.wait_booted()
        after = second.wait_all_ready(60)
        assert {e["name"]: e["pid"] for e in after["engines"]} == {e["name"]: e["pid"] for e in before["engines"]}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(stray):
            time.sleep(0.05)
        assert not _alive(stray)
        assert f"engine pid {stray}, forked by the previous spawn server but in no record" in second.log.read_text()
    finally:
        if second is not None:
            second.stop()
        h.stop()
        if second is None:
            from supervisor.effects.stale import check_and_clean
            check_and_clean(rt)


def test_the_first_rollout_after_a_readoption_never_waits_for_an_exit_status(tmp_path, tiny_model):
    """The rollout replaces the adopted spawn server first, so the adopted engines it forked are nobody's
    child when they drain: their statuses are read from /proc while init has not reaped them, else
    unknown, at once (it waited stop_timeout_s-like 10 s per engine: 27 s instead of 7 s)."""
    pair = Restarted(tmp_path, tiny_model)
    first = pair.first
    try:
        first.wait_booted()
        before = {e["name"]: e["pid"] for e in first.wait_all_ready(120)["engines"]}
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        second = pair.restart()
        second.wait_booted(60)
        st = second.wait_all_ready(60)
        assert {e["name"]: e["pid"] for e in st["engines"]} == before  # re-adopted, not restarted
        r = second.admin("POST", "/admin/rollout", timeout=300)
        assert r.status_code == 200, r.text
        assert sorted(r.json()["restarted"]) == ["a", "b"]
        text = second.log.read_text()
        assert "no exit status" not in text, text[-3000:]
        for name, pid in before.items():  # each adopted engine's drain was read (or said unknown) at once
            line = next(ln for ln in text.splitlines() if f"{name}: pid {pid} (incarnation" in ln)
            assert "exit code 0" in line or "exit status unknown" in line, line
    finally:
        pair.close()
