"""States, restart policy, exit decoding, sd_notify (on a real socket), golden canaries."""
from __future__ import annotations

import os
import socket
import uuid

import pytest

from supervisor.core.backoff import RestartPolicy
from supervisor.effects.canary import CanaryResult, GoldenStore, compare, model_fingerprint
from supervisor.core.exitstatus import describe_returncode
from supervisor.metrics import Metrics
from supervisor.effects.sdnotify import Notifier
from supervisor.core.states import ALLOWED, State, TransitionError, check_transition


def test_every_state_has_a_row():
    assert set(ALLOWED) == set(State)


@pytest.mark.parametrize("src, dst", [
    (State.STOPPED, State.STARTING), (State.STARTING, State.ATTACHING), (State.ATTACHING, State.WARMING),
    (State.WARMING, State.READY), (State.READY, State.DRAINING), (State.DRAINING, State.STOPPED),
    (State.READY, State.EXITED), (State.READY, State.FAILED), (State.EXITED, State.BACKOFF),
    (State.BACKOFF, State.STARTING), (State.EXITED, State.FATAL), (State.FATAL, State.STARTING),
])
def test_allowed_transitions(src, dst):
    check_transition(src, dst)


@pytest.mark.parametrize("src, dst", [
    (State.STOPPED, State.READY), (State.STARTING, State.STOPPED), (State.READY, State.STARTING),
    (State.FATAL, State.READY), (State.BACKOFF, State.READY), (State.EXITED, State.READY),
])
def test_refused_transitions(src, dst):
    with pytest.raises(TransitionError, match=f"{src.value} -> {dst.value} is not allowed"):
        check_transition(src, dst)


def test_backoff_grows_to_its_cap_and_flapping_is_a_verdict_not_an_end():
    p = RestartPolicy(base_s=0.5, max_s=3.0, window_s=60.0, max_failures=5)
    delays = [p.record_failure(now=float(i)) for i in range(4)]
    assert delays == [0.0, 0.5, 1.0, 2.0] and not p.flapping  # the first restarts at once
    assert p.record_failure(now=4.0) == 3.0 and p.flapping  # 5 failures within 60 s
    assert [p.record_failure(now=5.0 + i) for i in range(200)] == [3.0] * 200  # capped, forever
    p.record_success()  # READY again, but it flaps: no restart at once (the last engine standing waits)
    assert p.record_failure(now=206.0) == 0.5
    p.reset()
    assert p.record_failure(now=300.0) == 0.0 and not p.flapping


def test_restart_delay_holds_only_the_first_restart_after_ready():
    p = RestartPolicy(base_s=0.5, max_s=3.0, window_s=60.0, max_failures=5, first_s=1.5)
    assert [p.record_failure(now=float(i)) for i in range(3)] == [1.5, 0.5, 1.0]
    p.record_success()
    assert p.record_failure(now=10.0) == 1.5


def test_failures_outside_the_window_are_forgotten_and_success_resets_the_delay():
    p = RestartPolicy(base_s=1.0, max_s=100.0, window_s=10.0, max_failures=3)
    assert p.record_failure(now=0.0) == 0.0
    assert p.record_failure(now=1.0) == 1.0
    p.record_success()
    assert p.record_failure(now=20.0) == 0.0  # READY since: at once again; the two old ones left the window
    assert p.record_failure(now=21.0) == 1.0
    assert list(p.failures) == [20.0, 21.0]


def test_exit_statuses_are_decoded():
    assert describe_returncode(-9) == "killed by SIGKILL"
    assert describe_returncode(-15) == "killed by SIGTERM"
    assert describe_returncode(3) == "exit code 3"
    assert describe_returncode(0) == "exit code 0"
    assert describe_returncode(None) == "exit status unknown"


def _dgram(addr: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(2)
    return s


def test_sd_notify_on_a_path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _dgram(path) as s:
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
        assert n.enabled and n.watchdog_interval_s == 2.0
        assert n.ready("a=primary/READY")
        msg = s.recv(4096).decode().split("\n")
        assert msg[0] == "READY=1" and "STATUS=a=primary/READY" in msg and f"MAINPID={os.getpid()}" in msg
        n.watchdog()
        assert s.recv(4096) == b"WATCHDOG=1"
        n.stopping("bye")
        assert s.recv(4096) == b"STOPPING=1\nSTATUS=bye"


def test_sd_notify_on_an_abstract_socket():
    name = f"understudy-test-{uuid.uuid4().hex}"
    with _dgram("\0" + name) as s:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.status("hello")
        assert s.recv(4096) == b"STATUS=hello"


def test_sd_notify_never_blocks_when_nobody_reads(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _dgram(path):
        n = Notifier({"NOTIFY_SOCKET": path})
        sent = [n.status(f"message {i}") for i in range(2000)]  # (a blocking send would hang here)
        assert sent[0] is True and sent[-1] is False  # queue full: dropped, not blocked
        assert 0 < sent.count(True) < 2000


def test_sd_notify_outside_systemd_is_a_no_op():
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None and n.ready("x") is False
    assert Notifier({"NOTIFY_SOCKET": "/nonexistent/sock"}).ready("x") is False  # logged, never raised
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None


def test_golden_store_records_first_and_compares(tmp_path):
    g = GoldenStore(tmp_path)
    assert (tmp_path / "golden").stat().st_mode & 0o777 == 0o700
    first = g.record("k", CanaryResult(True, text=" jumps over"), "a")
    assert first["recorded_by"] == "a" and (tmp_path / "golden" / "k.json").stat().st_mode & 0o777 == 0o600
    assert g.record("k", CanaryResult(True, text="other"), "b")["text"] == " jumps over"
    assert compare(first, CanaryResult(True, text=" jumps over")) is None
    assert compare(first, CanaryResult(True, text="nope")) == "canary mismatch: expected ' jumps over', got 'nope'"
    ids = {"text": "x", "token_ids": [1, 2]}
    assert "token ids" in compare(ids, CanaryResult(True, text="x", token_ids=[1, 3]))


def test_fingerprint_changes_with_the_checkpoint_bytes_on_disk(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a" * 10)
    k1 = model_fingerprint(str(tmp_path), dtype="float32")
    assert k1 == model_fingerprint(str(tmp_path), dtype="float32")
    assert k1 != model_fingerprint(str(tmp_path), dtype="bfloat16")
    (tmp_path / "model.safetensors").write_bytes(b"b" * 11)
    assert k1 != model_fingerprint(str(tmp_path), dtype="float32")


def test_metric_names_match_the_design():
    m = Metrics()
    m.count_weights_source("cache_hit")
    m.count_weights_source("disk:mismatch content_digest")
    m.failovers.labels(reason="exit").inc()
    m.router_requests.labels(code="200").inc()
    m.daemon_resident.labels(rank="0").set(5)
    m.startup_phase.labels(phase="weights").observe(0.1)
    text = m.render().decode()
    for name in ("understudy_failovers_total{reason=\"exit\"}", "understudy_failover_seconds_bucket",
                 "understudy_recovery_seconds_bucket", "understudy_weight_cache_requests_total{reason=\"\",result=\"hit\"}",
                 "understudy_weight_cache_requests_total{reason=\"mismatch content_digest\",result=\"miss\"}",
                 "understudy_engine_startup_phase_seconds_bucket", "understudy_active_engines",
                 "understudy_standby_ready", "understudy_router_requests_total{code=\"200\"}",
                 "understudy_router_retries_total", "understudy_router_hold_seconds_bucket",
                 "understudy_daemon_resident_bytes{rank=\"0\"}"):
        assert name in text, name


def test_is_exiting_sees_a_killed_process_before_it_is_reaped():
    import signal
    import subprocess
    import sys
    import time

    from wire.proc import is_exiting

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_exiting(child.pid) and not is_exiting(os.getpid())
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not is_exiting(child.pid):  # exiting, then a zombie until we reap it
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        child.kill()
        child.wait()
    assert is_exiting(child.pid)  # reaped: gone


def test_watchdog_is_fed_while_serving_or_progressing_and_not_when_stuck():
    from supervisor.core.watchdog import WatchdogGate
    g = WatchdogGate(stuck_after_s=10.0, last_progress=100.0)
    assert g.should_feed(105.0, serving=False)           # starting: progress 5 s ago
    assert not g.should_feed(111.0, serving=False)       # no primary, no progress for 11 s: stuck
    assert g.stuck_for(111.0, serving=False) == 11.0
    assert g.should_feed(500.0, serving=True) and g.stuck_for(500.0, serving=True) == 0.0
    g.progress(111.0)                                    # a spawn, a phase, a transition
    assert g.should_feed(120.0, serving=False)
    g.progress(50.0)                                     # an older report never moves it back
    assert g.last_progress == 111.0


def test_stuck_window_defaults_to_startup_timeout_plus_four_backoff_caps():
    from supervisor.config import FailoverSection
    assert FailoverSection().stuck_window_s() == 300 + 4 * 30
    assert FailoverSection(stuck_after_s=7).stuck_window_s() == 7


def test_not_ready_text_says_what_each_engine_is_doing():
    from supervisor.core.model import Engine
    from supervisor.core.why import not_ready_text
    policy = RestartPolicy(0.5, 30, 120, 5)
    a = Engine("a", policy, state=State.BACKOFF, crash_loop=True, retry_at=130.0, last_exit="exit code 1",
                   log_line="engine a: failed to start: CheckpointError: model.safetensors truncated")
    b = Engine("b", policy, state=State.FATAL, reason="flapping: 5 failures within 120s")
    c = Engine("c", policy, state=State.WARMING, started_at=95.0, incarnation=3)
    d = Engine("d", policy, state=State.READY)
    text = not_ready_text([a, b, c, d], now=100.0)
    assert text == ("engine a: crash loop, next try in 30 s, last exit: exit code 1 (engine a: failed to start: "
                    "CheckpointError: model.safetensors truncated); engine b: FATAL: flapping: 5 failures within "
                    "120s; engine c: WARMING for 5 s (incarnation 3)")
    a.log_line, a.crash_loop = "(empty log)", False
    assert not_ready_text([a], 100.0) == "engine a: restarting, next try in 30 s, last exit: exit code 1"


@pytest.mark.parametrize("host, ok", [("127.0.0.1", True), ("::1", True), ("localhost", True), ("127.0.0.2", True),
                                      ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("myhost", False)])
def test_admin_host_must_be_loopback_unless_allowed(host, ok):
    from supervisor.config_load import ConfigError, parse_config
    text = f"admin: {{host: '{host}', port: 9001}}\n"
    if ok:
        assert parse_config(text, "c.yaml").admin.host == host
        return
    with pytest.raises(ConfigError, match=r"c.yaml: admin.host: '.*' is not a loopback address.*admin.allow_remote: true"):
        parse_config(text, "c.yaml")
    assert parse_config(f"admin: {{host: '{host}', allow_remote: true}}\n", "c.yaml").admin.allow_remote


def test_logs_are_rotated_per_start_never_appended_across_runs(tmp_path):
    import os
    from supervisor.effects.processes import open_log
    log = tmp_path / "logs" / "a-1.log"
    for run in ("first", "second", "third"):
        fd = open_log(log)
        os.write(fd, f"{run} run\n".encode())
        os.close(fd)
    assert log.read_text() == "third run\n"
    assert (tmp_path / "logs" / "a-1.log.1").read_text() == "second run\n"
    assert sorted(p.name for p in log.parent.iterdir()) == ["a-1.log", "a-1.log.1"]
    assert log.stat().st_mode & 0o777 == 0o600


def test_tests_never_write_the_users_cache():
    import os
    from supervisor.config import UnderstudyConfig
    home_cache = os.path.join(os.path.expanduser("~"), ".cache")
    assert not os.environ["UNDERSTUDY_CACHE_DIR"].startswith(home_cache)
    assert str(UnderstudyConfig().resolved_cache_dir()) == os.environ["UNDERSTUDY_CACHE_DIR"]
    from daemon.fingerprint import default_cache_dir
    assert str(default_cache_dir()) == os.environ["UNDERSTUDY_CACHE_DIR"]


def test_readme_links_exist_in_the_clone():
    import re
    from harness import ROOT
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", text) + re.findall(r"`([\w./-]+\.md)`", text):
        assert (ROOT / target).is_file(), f"README.md links {target}, which a clone does not have"


def test_the_supervisor_core_imports_no_torch():
    """torch costs seconds to import (3-5 s on the H200 host) and 200 MB: a restarted supervisor must
    not pay it before its router serves again (only serve's preflight checks of a model import it).
    numpy neither (~60 ms on the dev VM): the router frames a failover's batch without it."""
    import subprocess
    import sys
    code = ("import sys, supervisor.node, supervisor.effects.reaper; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_the_admin_token_is_made_private_once_and_a_path_that_cannot_hold_it_is_named(tmp_path):
    from wire.secret_file import TokenError, ensure_token
    path = tmp_path / "new" / "token"
    token = ensure_token(path)
    assert ensure_token(path) == token and len(token) > 30
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    (tmp_path / "file").write_text("x")
    with pytest.raises(TokenError, match="file/token: cannot create admin token: .*file is not a folder"):
        ensure_token(tmp_path / "file" / "token")


def test_the_status_table_shows_weights_and_kv_sources_and_never_cuts_a_reason() -> None:
    """Issue 52, item 8: `understudy status` has a KV column beside WEIGHTS, and a reason too long for
    its column is printed whole under the table (for a READY engine too)."""
    from supervisor.admin.client import format_status
    long = "canary passed in 1.20s after spawn (its answer took 30 ms), weights disk:protocol_error (degraded)"
    engine = dict(name="b", role="standby", state="READY", pid=42, incarnation=3, weights_source="disk:protocol_error",
                  kv_mode=None, kv_source="own:no_daemon", reason=long)
    st = dict(epoch=2, primary="a", drained=False, router_url="r", admin_url="a",
              model=dict(name="m", device="cpu", dtype="float32", tp_size=1), engines=[engine], daemons=[],
              recent_failovers=[])
    text = format_status(st)
    header, row = text.splitlines()[3:5]
    assert "WEIGHTS" in header and " KV " in header
    assert "disk:protocol_er" in row and "own:no_daemon" in row and row.endswith("...")
    assert f"b: {long}" in text.splitlines()
    engine.update(reason="", heartbeat={"cuda_graphs_pending": 9})  # (a restarted engine, READY before its last graphs)
    assert format_status(st).splitlines()[4].endswith("9 CUDA graphs to capture")
