"""A weight cache daemon started for a test (a real process), and waiting until it is ready."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from daemon import framing
from daemon.runtime_dir import daemon_socket_path

ROOT = Path(__file__).resolve().parent.parent


def start_daemon(model: Path, rank: int, tp: int, runtime_dir: Path, log: Path,
                 extra: list[str] = ()) -> subprocess.Popen:
    """`python -m daemon` for rank `rank` of `tp` on CPU (`extra` may name another device: the last
    `--device` counts), its output appended to `log`."""
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "daemon", "--model", str(model), "--rank", str(rank),
                                 "--tp-size", str(tp), "--device", "cpu", "--runtime-dir", str(runtime_dir), *extra],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def wait_daemon_ready(proc: subprocess.Popen, runtime_dir: Path, rank: int, log: Path, timeout: float = 60) -> None:
    """Until the daemon answers `status` with state ready (an engine in `client` mode started
    before that loads from disk: `disk:no_daemon`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"daemon rank {rank} exited {proc.returncode}: {log.read_text()}"
        try:
            status = framing.request(daemon_socket_path(runtime_dir, rank), {"op": "status"}, 5)
            if status["daemon"]["state"] == "ready":
                return
        except (OSError, framing.FrameError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"daemon rank {rank} not ready after {timeout} s: {log.read_text()}")
