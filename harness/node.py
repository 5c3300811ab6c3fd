"""A real supervisor in a subprocess, for integration tests and benchmarks: start it from a config,
talk to its admin API, watch its events (zmq SUB) and sd_notify messages, drive load, stop it."""
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import zmq

ROOT = Path(__file__).resolve().parent.parent


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
            from supervisor.socket_activation import handover_argv
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
            try:
                st = json.loads((self.rd / "state.json").read_text())
                if st.get("admin_url") and st.get("pid") == self.proc.pid:
                    break
            except (OSError, ValueError):
                pass
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
        """A primary serving, every engine READY with no pending stop, every daemon READY."""
        return self.wait_for(lambda st: st["primary"] is not None
                             and all(e["state"] == "READY" for e in st["engines"])
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
                    from supervisor.stale import check_and_clean
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


@dataclass
class Load:
    """Steady load: ``threads`` clients sending completions back to back through the router."""

    url: str
    model: str
    threads: int = 2
    max_tokens: int = 4
    stream: bool = False
    results: list[tuple[float, float, int | str, str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._watch: tuple[str, float, threading.Event, list[float]] | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.threads)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0.0, "stream": self.stream}
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = c.post(self.url + "/v1/completions", json=body)
                    ok = r.status_code
                    if self.stream and r.status_code == 200 and "[DONE]" not in r.text:
                        ok = "stream cut"
                    end, engine = time.monotonic(), r.headers.get("x-understudy-engine")
                    self.results.append((t0, end, ok, engine))
                    w = self._watch
                    if w is not None and ok == 200 and engine == w[0] and end >= w[1] and not w[2].is_set():
                        w[3].append(end)
                        w[2].set()
                except httpx.HTTPError as e:
                    self.results.append((t0, time.monotonic(), f"{type(e).__name__}: {e}", None))

    @property
    def failures(self) -> list:
        return [r for r in self.results if r[2] != 200]

    def watch(self, engine: str, after: float) -> tuple[threading.Event, list[float]]:
        """An event set (with its completion time) by the first success from ``engine`` after ``after``."""
        ev, out = threading.Event(), []
        self._watch = (engine, after, ev, out)
        return ev, out

    def first_success_from(self, engine: str, after: float) -> float | None:
        """Completion time of the first success served by ``engine`` that started after ``after``."""
        times = [end for start, end, code, eng in self.results if code == 200 and eng == engine and end >= after]
        return min(times) if times else None


def listening(host: str = "127.0.0.1", backlog: int = 4096) -> socket.socket:
    """A listening TCP socket on a free port, to hand over to a supervisor (``Harness(held=...)``)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.bind((host, 0))
    s.listen(backlog)
    return s


class OpenLoad:
    """Open-loop load: a completion every 1/rate s whatever the answers, each on a fresh connection
    (so refused connections are seen), with http.client (light on CPU). ``results``: (start, end,
    outcome) with outcome "ok", "refused", "HTTP <code>" or the error."""

    def __init__(self, url: str, model: str, rate: float = 20.0, max_tokens: int = 4) -> None:
        self.url, self.model, self.rate, self.max_tokens = url, model, rate, max_tokens
        self.results: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def start(self) -> "OpenLoad":
        self._ticker.start()
        return self

    def _tick(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            t = threading.Thread(target=self.one, daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            nxt += 1 / self.rate
            time.sleep(max(0.0, nxt - time.monotonic()))

    def one(self, max_tokens: int | None = None) -> None:
        """One request (``max_tokens`` generated, EOS ignored); its outcome is appended to results."""
        import http.client
        t0 = time.monotonic()
        body = json.dumps({"model": self.model, "prompt": "Once upon a time", "temperature": 0.0,
                           "max_tokens": max_tokens or self.max_tokens, "ignore_eos": True})
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
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
        for t in list(self._threads):
            t.join(90)
