"""A real supervisor in a subprocess, for integration tests, chaos and benchmarks: start it from a
config, talk to its admin API, watch its events (zmq SUB) and sd_notify messages, stop it."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import zmq

from harness import ROOT
from harness.state_file import read_state


class Harness:
    """``understudy serve -c CONFIG`` as a child, with a NOTIFY_SOCKET we own and an event log."""

    def __init__(self, workdir: Path, config_text: str, notify: bool = True,
                 env: dict[str, str] | None = None, held: dict[str, socket.socket] | None = None) -> None:
        """``held``: listening sockets handed over as systemd socket activation does (name -> socket)."""
        self.workdir = workdir
        self.config = workdir / "understudy.yaml"
        self.config.write_text(config_text)
        self.log = workdir / "supervisor.log"
        self.notify_path = str(workdir / "notify.sock")
        self.notify_msgs: list[str] = []
        self._notify = None
        self._stop = threading.Event()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if notify:
            self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._notify.bind(self.notify_path)
            self._notify.settimeout(0.2)
            env["NOTIFY_SOCKET"] = self.notify_path
            threading.Thread(target=self._read_notify, daemon=True).start()
        self._logf = open(self.log, "w")
        argv = [sys.executable, "-m", "supervisor", "serve", "-c", str(self.config)]
        fds = [s.fileno() for s in (held or {}).values()]
        if held:
            from harness.handover import handover_argv
            argv = handover_argv(fds, list(held), argv)
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self._logf, stderr=subprocess.STDOUT, env=env,
                                     pass_fds=fds)
        self.events: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}

    # ---- discovery
    def wait_booted(self, timeout_s: float = 120.0) -> None:
        """Until state.json names the admin URL, then subscribe to events."""
        from supervisor.config_load import load_config
        cfg = load_config(self.config)
        self.rd = cfg.resolved_runtime_dir()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            st = read_state(self.rd)
            if st is not None and st.get("admin_url") and st.get("pid") == self.proc.pid:
                break
            time.sleep(0.05)
        else:
            raise TimeoutError(f"supervisor did not write state.json; log:\n{self.tail()}")
        self.admin_url, self.router_url = st["admin_url"], st["router_url"]
        self.token = cfg.resolved_token_file().read_text().strip()
        threading.Thread(target=self._read_events, args=(st["events"],), daemon=True).start()
        time.sleep(0.2)  # slow joiner

    def _read_events(self, endpoint: str) -> None:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.RCVTIMEO, 200)
        s.connect(endpoint)
        while not self._stop.is_set():
            try:
                self.events.append(json.loads(s.recv()))
            except zmq.Again:
                continue
        s.close(0)

    def _read_notify(self) -> None:
        while not self._stop.is_set():
            try:
                self.notify_msgs.append(self._notify.recv(4096).decode())
            except (socket.timeout, OSError):
                continue

    # ---- admin
    def admin(self, method: str, path: str, token: str | None = "default", timeout: float = 120.0) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {self.token if token == 'default' else token}"}
        return httpx.request(method, self.admin_url + path, headers=headers, timeout=timeout)

    def status(self) -> dict[str, Any]:
        r = self.admin("GET", "/status")
        r.raise_for_status()
        self.state = r.json()
        return self.state

    def engines(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.status()["engines"]}

    def primary(self) -> dict[str, Any]:
        st = self.status()
        return next(e for e in st["engines"] if e["name"] == st["primary"])

    def standby(self) -> dict[str, Any]:
        return next(e for e in self.status()["engines"] if e["role"] == "standby")

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 60.0, what: str = "") -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            st = self.status()
            if pred(st):
                return st
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what or pred}; status:\n{json.dumps(self.state, indent=1)}"
                           f"\nlog:\n{self.tail()}")

    def wait_all_ready(self, timeout_s: float = 60.0) -> dict:
        """A primary serving, every engine READY with its CUDA graphs all captured (some come after
        READY: EngineConfig.cuda_graphs_before_ready), every daemon READY: the node in its steady state."""
        return self.wait_for(lambda st: st["primary"] is not None
                             and all(e["state"] == "READY" and not (e.get("heartbeat") or {}).get("cuda_graphs_pending")
                                     for e in st["engines"])
                             and sum(e["role"] == "primary" for e in st["engines"]) == 1
                             and all(d["state"] == "READY" for d in st["daemons"]), timeout_s, "all READY")

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0, since: int = 0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events[since:]:
                if pred(ev):
                    return ev
            time.sleep(0.02)
        raise TimeoutError(f"no such event; got {self.events[since:][-20:]}\nlog:\n{self.tail()}")

    def metrics(self) -> str:
        return self.admin("GET", "/metrics").text

    # ---- lifecycle
    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"supervisor exited with {self.proc.returncode}; log:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                if getattr(self, "rd", None) is not None:  # do not leak its children into the next test
                    from supervisor.effects.stale import check_and_clean
                    check_and_clean(self.rd)
        self._stop.set()
        self._logf.close()
        if self._notify is not None:
            self._notify.close()
        return self.proc.returncode


def closed_by_peer(s: socket.socket, within_s: float) -> bool:
    """The other end closed (or reset) the connection within `within_s` seconds."""
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@contextmanager
def running(work: Path, config_text: str, ready_timeout_s: float = 120, **kw: Any) -> Iterator[Harness]:
    """A supervisor on `config_text` (Harness keywords in `kw`), booted with every engine READY;
    stopped on exit."""
    h = Harness(work, config_text, **kw)
    try:
        h.wait_booted()
        h.wait_all_ready(ready_timeout_s)
        yield h
    finally:
        h.stop()
