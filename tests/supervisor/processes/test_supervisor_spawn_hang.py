"""A hung spawn server (an operator's review, real processes, CPU, tiny model): SIGSTOPped, it held an
engine's spawn request past the supervisor's timeout, the engine was started directly, and when it
was continued it forked a second engine nobody tracked, which outlived the supervisor. Now a spawn it
does not answer within SPAWN_TIMEOUT_S marks it hung: it is killed (its queued request with it) and
replaced, and the engine starts directly meanwhile. Once that node stopped, `understudy status` says so
(it blamed the config's admin port)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from harness.node import Harness
from supervisor.effects.processes import SPAWN_TIMEOUT_S

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}}
failover: {{heartbeat_timeout_s: 3, probe_interval_s: 1, probe_timeout_s: 5, hold_timeout_s: 30, exit_poll_ms: 0,
           backoff_base_s: 0.1, backoff_max_s: 1}}
router: {{port: 0}}
admin: {{port: 0}}
"""


def engines_named(name: str) -> list[int]:
    """Pids of the processes that run engine `name`'s scheduler (`engine-NAME`, front ends aside)."""
    out = []
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == f"engine-{name}":
            out.append(p.pid)
    return out


def test_a_spawn_server_that_does_not_answer_is_replaced_and_forks_no_untracked_engine(tmp_path, tiny_model) -> None:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    h = Harness(tmp_path, CONFIG.format(rt=rt, model=tiny_model), notify=False)
    stopped = None
    try:
        h.wait_booted()
        h.wait_all_ready(120)
        stopped = h.status()["spawn_server"]["pid"]
        b = h.engines()["b"]
        os.kill(stopped, signal.SIGSTOP)
        os.killpg(b["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        st = h.wait_for(lambda st: any(e["name"] == "b" and e["incarnation"] > b["incarnation"] and e["state"] == "READY"
                                       for e in st["engines"]), 60 + SPAWN_TIMEOUT_S, "b started again, directly")
        assert time.monotonic() - t0 < SPAWN_TIMEOUT_S + 30
        h.wait_for(lambda st: (st["spawn_server"] or {}).get("pid") not in (None, stopped), 120,
                   "a new spawn server READY")  # (status names a READY one only)
        assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == psutil.STATUS_ZOMBIE
        assert "did not answer a spawn within" in h.log.read_text()
        time.sleep(1)  # (an engine the old one forked late would be starting now)
        b_now = next(e for e in h.status()["engines"] if e["name"] == "b")
        assert engines_named("b") == [b_now["pid"]], (engines_named("b"), b_now)
        assert st["primary"]
    finally:
        if stopped is not None and psutil.pid_exists(stopped):
            os.kill(stopped, signal.SIGCONT)
        h.stop()
    r = subprocess.run([sys.executable, "-m", "supervisor", "status", "-c", str(h.config)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and f"the last supervisor of {rt}" in r.stderr and "stopped" in r.stderr, r.stderr
