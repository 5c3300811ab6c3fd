"""An external engine's own weight cache daemon (engines.external.daemon_command) in the supervisor's pass:
started first and polled with its readiness check ("up") until it passes, the engines after it; a daemon
that exits is restarted while the engines serve, and an engine that restarts meanwhile waits for it; one
that never came up stops the boot with a line naming the key. Played as events (tests/decision_table.py);
the same with real processes: tests/supervisor/external/test_external_daemons.py."""
from __future__ import annotations

from decision_table import Play, in_order


def external(**kw) -> Play:
    return Play(external=True, spawn_server=False, daemons=1, **kw)


def booted() -> Play:
    p = external()
    p.play(("launched", "daemon-rank0"), ("ping", "daemon-rank0", True))
    p.play(("launched", "a"), ("ready", "a"), ("launched", "b"), ("ready", "b"))
    p.actions.clear()
    return p


def test_the_daemon_is_polled_until_its_check_passes_and_the_engines_start_after_it() -> None:
    p = external()
    got = p.play(("launched", "daemon-rank0"), ("ping", "daemon-rank0", False))
    assert in_order(got, ["start daemon-rank0", "probe daemon-rank0 up"]) and p.state("daemon-rank0") == "STARTING"
    assert not any(g.startswith("start a") for g in got), got
    got = p.play(("wait", 0.25), ("ping", "daemon-rank0", True))
    assert in_order(got, ["probe daemon-rank0 up", "publish daemon-rank0 READY", "start a via external",
                          "start b via external"]), got
    got = p.play(("launched", "a"), ("ready", "a"), ("wait", 5.0))
    assert p.state("a") == "READY primary" and "probe daemon-rank0 ping" not in got  # (not our protocol: no pings)


def test_a_dead_daemon_is_restarted_while_the_engines_serve_and_a_restarting_engine_waits_for_it() -> None:
    p = booted()
    got = p.play(("exit", "daemon-rank0"), ("exit read", "daemon-rank0", -9))
    assert in_order(got, ["fence daemon-rank0", "publish daemon-rank0 EXITED", "reap daemon-rank0",
                          "publish daemon-rank0 BACKOFF", "start daemon-rank0"]), got
    assert p.state("a") == "READY primary" and "publish failover" not in got
    got = p.play(("exit", "b"), ("exit read", "b", -9), ("wait", 0.5))
    assert p.state("b") == "STARTING standby"
    assert "start b via external" not in got, "b waits for its daemon"
    got = p.play(("launched", "daemon-rank0"), ("ping", "daemon-rank0", True))
    assert in_order(got, ["publish daemon-rank0 READY", "start b via external"]), got
    assert p.node.daemons[0].state.value == "READY" and p.state("a") == "READY primary"


def test_a_daemon_that_exits_before_it_is_ready_stops_the_boot_naming_the_key() -> None:
    p = external()
    p.play(("launched", "daemon-rank0"), ("exit", "daemon-rank0"), ("exit read", "daemon-rank0", 2))
    halt = next(a.text for a in p.actions if a.brief() == "notify boot failed")
    assert halt.startswith("engines.external.daemon_command: daemon-rank0 stopped before it was ready (exit code 2"), halt
    assert not any(a.brief().startswith("start a") for a in p.actions)


def test_a_daemon_command_that_cannot_start_stops_the_boot_naming_the_key() -> None:
    p = external()
    p.play(("launch failed", "daemon-rank0", "engines.external.daemon_command: cannot run it: [Errno 2] No such "
                                             "file or directory: 'vllm'"))
    halt = next(a.text for a in p.actions if a.brief() == "notify boot failed")
    assert "engines.external.daemon_command: cannot run it: [Errno 2]" in halt, halt


def test_a_daemon_whose_check_never_passes_stops_the_boot_after_the_load_timeout() -> None:
    p = external()
    p.play(("launched", "daemon-rank0"), ("ping", "daemon-rank0", False), ("wait", 601))
    halt = next(a.text for a in p.actions if a.brief() == "notify boot failed")
    assert halt == "engines.external.daemon_ready not passed after 600s (daemons.load_timeout_s)", halt


def test_a_restarted_daemon_whose_check_never_passes_is_failed_and_fenced() -> None:
    p = booted()
    p.play(("exit", "daemon-rank0"), ("exit read", "daemon-rank0", -9), ("launched", "daemon-rank0"),
           ("wait", 601))
    assert p.node.daemons[0].reason.startswith("engines.external.daemon_ready (/rt/daemon-rank0.sock) not passed "
                                               "within daemons.load_timeout_s=600s")
    assert "fence daemon-rank0" in [a.brief() for a in p.actions]
