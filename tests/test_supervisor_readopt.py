"""Supervisor restart without dropping the node (real processes, CPU, tiny model): the test holds the
listening sockets as systemd's understudy.socket would, SIGKILLs the supervisor under ~20 req/s,
starts a new one on the same sockets, and checks that it re-adopts the live daemon, spawn server and
engines (same pids, roles, epoch), that no connection is refused, and that only requests in flight
inside the dead process are lost."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time

import psutil

from supervisor.testing import Harness

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}}
failover: {{heartbeat_timeout_s: 3, probe_interval_s: 1, probe_timeout_s: 5, hold_timeout_s: 20,
           backoff_base_s: 0.1, backoff_max_s: 1, drain_timeout_s: 10, stop_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""

RATE = 20.0  # requests per second, each on a new connection


def listening(backlog: int = 4096) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.bind(("127.0.0.1", 0))
    s.listen(backlog)
    return s


class OpenLoad:
    """Open-loop load: one request every 1/RATE s, each on its own connection, outcome recorded."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.results: list[tuple[float, float, str]] = []  # (start, end, "ok" | "refused" | error)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def start(self) -> "OpenLoad":
        self._ticker.start()
        return self

    def _tick(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self._threads.append(t)
            nxt += 1 / RATE
            time.sleep(max(0.0, nxt - time.monotonic()))

    def _one(self, max_tokens: int = 4) -> None:
        """http.client on a fresh connection: light on CPU (this box also runs the node under test)."""
        t0 = time.monotonic()
        body = json.dumps({"model": self.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True})
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            outcome = "ok" if r.status == 200 else f"HTTP {r.status}"
        except ConnectionRefusedError:
            outcome = "refused"
        except (OSError, http.client.HTTPException) as e:
            outcome = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        self.results.append((t0, time.monotonic(), outcome))

    def stop(self) -> None:
        self._stop.set()
        self._ticker.join(5)
        for t in self._threads:
            t.join(60)


def test_sigkill_supervisor_restarts_on_the_same_socket_and_readopts_everything(tmp_path, tiny_model):
    router, admin = listening(), listening()
    held = {"router": router, "admin": admin}
    url = "http://127.0.0.1:%d" % router.getsockname()[1]
    cfg = CONFIG.format(rt=tmp_path / "rt", model=tiny_model)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Harness(tmp_path / "a", cfg, notify=False, held=held)
    second = None
    try:
        first.wait_booted()
        assert first.router_url == url  # the handed-over socket, not a new one
        before = first.wait_all_ready(120)
        load = OpenLoad(url, tiny_model.name).start()
        time.sleep(2.0)
        long = threading.Thread(target=load._one, args=(120,))  # surely in flight in the process killed
        long.start()
        time.sleep(0.1)
        assert long.is_alive()
        t_kill, wall_kill = time.monotonic(), time.time()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        second = Harness(tmp_path / "b", cfg, notify=False, held=held)  # as systemd restarts it
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
        assert any(t_kill - 0.2 < start < t_kill - 0.05 for start, _, _ in failed), (t_kill, failed)
        later = [end for start, end, out in res if out == "ok" and end > t_kill]
        assert later, res[-10:]
        gap = min(later) - t_kill  # SIGKILL -> first answer served by the new supervisor
        stamp = line.split(" understudy ")[0]
        adopted = time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(stamp[-3:]) / 1000
        print(f"\nreadopt: {len(res)} requests at {RATE:g}/s, {len(failed)} lost (in flight in the killed "
              f"supervisor), 0 refused, serving again {gap:.2f} s after SIGKILL (children "
              f"re-adopted at +{adopted - wall_kill:.2f} s)")
        assert sum(out == "ok" for _, _, out in res) >= len(res) - len(failed)
        assert gap < 5.0, gap  # the target is 2 s; a 2-core CI box shared with other jobs gets slack

        # the normal stop (SIGTERM) still stops every child, adopted or not
        pids = [p for p, _, _ in ident(after)[0].values()] + list(ident(after)[1].values()) \
            + [after["spawn_server"]["pid"]]
        assert second.stop() == 0
        second = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)]
    finally:
        if second is not None:
            second.stop()
        first.stop()
        if first.proc.returncode == -signal.SIGKILL and second is None:
            from supervisor.stale import check_and_clean
            check_and_clean(tmp_path / "rt")
        router.close()
        admin.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_chaos_kill_supervisor_fault_restarts_it_on_its_own_sockets(tmp_path, tiny_model):
    """The chaos fault `kill-supervisor` on a supervisor that bound its ports itself: chaos takes
    copies of its listening sockets (pidfd_getfd), SIGKILLs it and starts it again on them."""
    import asyncio

    from supervisor.chaos.admin import AdminClient
    from supervisor.chaos.faults import FaultInjector, replaced, settled
    from supervisor.chaos.status_view import parse_status

    h = Harness(tmp_path, CONFIG.format(rt=tmp_path / "rt", model=tiny_model), notify=False)
    new_pid = None
    try:
        h.wait_booted()
        before = h.wait_all_ready(120)
        load = OpenLoad(h.router_url, tiny_model.name).start()
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
        assert all(start + wall_offset < t_kill + 0.5 for start, _, _ in lost), lost
        print(f"\nchaos kill-supervisor: {len(res)} requests, {len(lost)} lost, down {fault.detail['down_s']} s")
    finally:
        if new_pid is not None:  # the restarted supervisor is chaos's child, not the harness's
            os.kill(new_pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _alive(new_pid):
                time.sleep(0.1)
        h.stop()
        if h.proc.returncode == -signal.SIGKILL and new_pid is None:
            from supervisor.stale import check_and_clean
            check_and_clean(tmp_path / "rt")
