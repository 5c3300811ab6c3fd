"""`understudy chaos` against a real supervisor (tiny model, CPU): a few SIGKILLs under load, a wrong
token, and a supervisor that stops in the middle of a run. Real processes, nothing mocked."""
from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.chaos.cli import EXIT_ABORTED, EXIT_OK, main
from harness.node import Harness


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Harness]:
    """`understudy serve` on the tiny model, ports chosen by the OS (chaos finds them in state.json)."""
    tmp = tmp_path_factory.mktemp("chaos-live")
    h = Harness(tmp, f"device: cpu\nruntime_dir: {tmp / 'rt'}\ncache_dir: {tmp / 'cache'}\n"
                     f"model: {{path: {tiny_model}}}\nrouter: {{port: 0}}\nadmin: {{port: 0}}\n", notify=False)
    try:
        h.wait_booted(90.0)
        h.wait_all_ready(90.0)
        yield h
    finally:
        h.stop()


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_wrong_token_is_reported(live: Harness, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "token"
    bad.write_text("not-the-token\n")
    out = tmp_path / "r"
    assert main(["-c", str(live.config), "--token-file", str(bad), "--out", str(out)]) == EXIT_ABORTED
    assert "admin token rejected (401)" in capsys.readouterr().err
    assert "token rejected" in _report(out)["aborted"]


def test_sigkills_under_load(live: Harness, tmp_path: Path) -> None:
    out = tmp_path / "r"
    mark = len(live.events)
    code = main(["-c", str(live.config), "--out", str(out), "--faults", "kill-primary:3,kill-daemon:1",
                 "--rate", "15", "--interval", "1", "--warmup", "1", "--settle", "20", "--duration", "60",
                 "--seed", "1"])
    report = _report(out)
    assert code == EXIT_OK, report["checks"]
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "latency.png", "raw.jsonl"}
    faults = report["faults"]
    assert [f["kind"] for f in faults].count("kill-primary") == 3 and all(f["error"] is None for f in faults)
    for f in faults:
        if f["kind"] == "kill-primary":
            assert f["failover_method"] == "engine-header" and f["new_primary"] not in (None, f["target"])
            assert f["failover_s"] > 0 and f["recovery_s"] > 0  # (how fast: bench failover, not this test)
            assert f["weights_source"] == "cache_hit"
        else:
            assert f["target_role"] == "daemon" and f["recovery_s"] is not None
    req = report["requests"]
    assert req["all"]["sent"] > 50 and req["non_streaming"]["failed"] == 0, req
    # (the daemon's restart moves the node onto its new KV pool: a planned switchover, supervisor/core/healing.py)
    healed = [e for e in live.events[mark:] if e.get("type") == "failover" and e.get("reason") == "promote"]
    assert report["failover"]["n"] == 3 and len(healed) <= 1 and report["failovers_observed"] == 3 + len(healed)
    assert not report["active_engines"]["ever_more_than_one"]
    assert report["cache"]["hits"] >= 3 and report["cache"]["misses"] == 0
    honest = {m["name"]: m for m in report["honest_metrics"]}
    for name in ("failovers (count)", "recoveries (count)", "weight cache hits", "router requests"):
        assert honest[name]["agree"] is True, honest[name]
    assert report["memory"]["start"]["processes"] >= 4 and report["memory"]["end"]["rss_bytes"] > 0
    checks = {c["name"]: c["ok"] for c in report["checks"]}
    assert checks["no failed non-streaming request"] and checks["exactly one active engine outside failovers"]


def test_sigstop_primary_is_detected_as_hung_fenced_and_failed_over(live: Harness, tmp_path: Path) -> None:
    out = tmp_path / "r"
    code = main(["-c", str(live.config), "--out", str(out), "--faults", "stop-primary:1", "--rate", "10",
                 "--interval", "1", "--warmup", "1", "--settle", "20", "--duration", "60", "--stop-release", "30"])
    report = _report(out)
    assert code == EXIT_OK, report["checks"]
    (f,) = report["faults"]
    assert f["kind"] == "stop-primary" and f["error"] is None and f["target_role"] == "primary"
    assert f["new_primary"] not in (None, f["target"]) and f["failover_s"] > 0 and f["recovery_s"] is not None
    assert not any("chaos sent SIGCONT" in n for n in report["notes"]), "the stopped primary was fenced (SIGKILL)"
    assert any(e.get("type") == "failover" and e.get("reason") == "hang" for e in live.events)


def test_supervisor_stopping_mid_run_gives_a_partial_report(live: Harness, tmp_path: Path) -> None:
    out = tmp_path / "r"
    timer = threading.Timer(4.0, live.proc.send_signal, args=(signal.SIGTERM,))
    timer.start()
    try:
        code = main(["-c", str(live.config), "--out", str(out), "--faults", "kill-standby:20",
                     "--rate", "10", "--interval", "1", "--warmup", "1", "--dead-after", "2",
                     "--request-timeout", "5", "--duration", "60"])
    finally:
        timer.cancel()
    assert code == EXIT_ABORTED  # at --dead-after once the supervisor is gone (not --duration 60): see aborted
    report = _report(out)
    assert "stopped answering" in report["aborted"]
    assert report["requests"]["all"]["sent"] > 0 and 0 < len(report["faults"]) < 20
    assert live.proc.wait(timeout=40) == 0
