"""Start an engine as a child process and wait until it serves (used by bench and tests).

The engine prints `ENGINE_READY {"port": ..., ...}` once its HTTP server listens; the caller
reads the port from that line, so `port: 0` works.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from wire.engine_config import EngineConfig
from harness import ROOT

READY_PREFIX = "ENGINE_READY "


class EngineStartError(RuntimeError):
    """The engine exited or timed out before serving; the message holds its log tail."""


def read_ready_line(log_path: str | Path) -> dict | None:
    """The JSON of the engine's ENGINE_READY line in its log, or None if not there yet."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        if line.startswith(READY_PREFIX):
            return json.loads(line[len(READY_PREFIX):])
    return None


def log_tail(log_path: str | Path, n: int = 40) -> str:
    try:
        return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


class EngineProcess:
    """`python -m engines` in its own session (process group); stdout and stderr go to `log_path`."""

    def __init__(self, cfg: EngineConfig, log_path: str | Path, env: dict | None = None):
        self.cfg, self.log_path = cfg, Path(log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engines", "--config-json", cfg.model_dump_json()],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, **(env or {})}, cwd=ROOT)
        self.pid = self.proc.pid
        self.ready: dict | None = None

    def wait_ready(self, timeout: float = 60.0, all_graphs: bool = True) -> dict:
        """Block until the ENGINE_READY line, and (`all_graphs`) until every CUDA graph the engine left
        for after ready is captured (so that a test's steps take the graphs of their size); returns the
        ready line (`port`, `pid`, `weights_source`)."""
        self.ready = wait_for_ready_line(self.log_path, timeout, lambda: self.proc.poll())
        if all_graphs and "more when the engine has time" in self.log_path.read_text(errors="replace"):
            all_graphs_line(self.log_path, timeout)
        return self.ready

    @property
    def url(self) -> str:
        assert self.ready, "call wait_ready() first"
        return f"http://{self.cfg.host}:{self.ready['port']}"

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (drain) then SIGKILL after `timeout`; returns the exit code."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)
        return self.proc.wait()


def wait_for_ready_line(log_path: str | Path, timeout: float, exited) -> dict:  # noqa: ANN001
    """Poll `log_path` for ENGINE_READY; `exited()` returns an exit code once the engine is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = read_ready_line(log_path)
        if ready:
            return ready
        rc = exited()
        if rc is not None:
            raise EngineStartError(f"engine exited with {rc} before serving; log tail:\n{log_tail(log_path)}")
        time.sleep(0.02)
    raise EngineStartError(f"engine not ready after {timeout:.0f} s; log tail:\n{log_tail(log_path)}")


def all_graphs_line(log_path: str | Path, timeout: float = 120.0) -> str:
    """The engine's line saying every CUDA graph is captured (some after ready: EngineConfig's
    cuda_graphs_before_ready), once it is in `log_path`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [ln for ln in Path(log_path).read_text(errors="replace").splitlines() if "CUDA graphs: all " in ln]
        if lines:
            return lines[0]
        time.sleep(0.05)
    raise EngineStartError(f"not every CUDA graph captured after {timeout:.0f} s; log tail:\n{log_tail(log_path)}")


def first_completion(url: str, model: str, timeout: float = 30.0) -> list[str]:
    """A greedy 4-token completion through the HTTP path (a readiness canary); returns the text."""
    r = httpx.post(f"{url}/v1/completions", timeout=timeout,
                   json={"model": model, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0})
    r.raise_for_status()
    return [c["text"] for c in r.json()["choices"]]
