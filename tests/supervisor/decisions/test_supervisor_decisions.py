"""The supervisor's decisions as a table (supervisor/core/): each row is a scenario of the integration
tests (test_supervisor_failover, _external, _tp, _readopt, test_chaos_live), played as events into a
node, with the actions it must decide (in this order, among others) and the states it must end in.
No process, socket or sleep: a pass is a function of the node, the events and the given time."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from decision_table import Play, boot_steps, in_order, serving

EXIT = [("exit read", "a", -9)]  # a SIGKILLed process's status


@dataclass
class Row:
    id: str
    events: list[tuple]
    actions: list[str]                                     # decided in this order (others may come between)
    states: dict[str, str] = field(default_factory=dict)   # child -> "STATE role"
    absent: list[str] = field(default_factory=list)        # never decided
    counts: dict[str, int] = field(default_factory=dict)   # decided exactly this many times
    given: str = "serving"                                 # serving: a primary, b standby (epoch 1)
    options: dict = field(default_factory=dict)            # failover settings, engines, tp_size...


ROWS = [
    # ---- failover
    Row("SIGKILL of the primary: fenced, the standby promoted at once, the dead one back as standby",
        [("exit", "a"), *EXIT, ("wait", 0.2), ("launched", "a"), ("ready", "a")],
        ["fence a", "publish failover", "publish a EXITED", "reap a", "promote b epoch 2",
         "publish a BACKOFF", "start a via spawn", "probe a ready", "publish a READY", "publish recovered"],
        {"a": "READY standby", "b": "READY primary"}),
    Row("the router is told the next primary (a connection kept open to it): none while the standby is the "
        "primary and the dead one restarts, the restarted one's URL once it is READY",
        [("exit", "a"), *EXIT, ("wait", 0.2), ("launched", "a"), ("ready", "a")],
        ["promote b epoch 2", "next primary none", "probe a ready", "next primary http://127.0.0.1:1005"],
        {"a": "READY standby"}, counts={"next primary none": 1}),
    Row("a killed TP worker rank takes its engine down: the group is waited for before the restart",
        [("exit", "a")], ["fence a", "reap a", "promote b epoch 2"], {"a": "EXITED standby"},
        options={"tp_size": 2}),
    Row("a primary SIGKILLed from outside: the router learns its loss is no evidence against the requests it ran",
        [("exit", "a"), ("exit read", "a", -9)], ["promote b epoch 2", "loss cause epoch 1 killed from outside"],
        {"b": "READY primary"}),
    Row("a primary that crashed (exit code 1): its loss counts toward a quarantine",
        [("exit", "a"), ("exit read", "a", 1)], ["promote b epoch 2", "loss cause epoch 1 evidence"],
        {"b": "READY primary"}),
    Row("a hung primary, fenced (the SIGKILL in its exit status is ours): its loss counts toward a quarantine",
        [("heartbeat", "a", 1), ("heartbeat", "b", 1), ("wait", 1.0), ("heartbeat", "b", 1), ("wait", 0.6),
         ("exit", "a"), ("exit read", "a", -9)],
        ["fence a", "promote b epoch 2", "loss cause epoch 1 evidence"], {"b": "READY primary"}),
    Row("a standby that came up on disk weights and its own KV while the daemon was away is replaced once "
        "it is READY again (issue 52, item 5); one on the daemon is left alone",
        [("said", "a", "startup", {"phases": {}, "weights_source": "cache_hit", "kv_source": "shared"}),
         ("said", "b", "startup", {"phases": {}, "weights_source": "disk:no_daemon", "kv_source": "own:no_daemon"}),
         ("wait", 0.2), ("exit", "daemon-rank0"), ("exit read", "daemon-rank0", -9), ("wait", 0.3),
         ("launched", "daemon-rank0"), ("wait", 0.2), ("daemon ready", "daemon-rank0"), ("wait", 0.2)],
        ["start daemon-rank0", "publish daemon-rank0 READY", "publish healing", "drain b"],
        {"a": "READY primary", "b": "DRAINING standby"}, counts={"drain b": 1}, absent=["drain a"]),
    Row("a degraded standby started after the daemon was READY is left as it is (a new one would be the same)",
        [("said", "b", "startup", {"phases": {}, "weights_source": "disk:mismatch", "kv_source": "own"}),
         ("wait", 0.5)], [], {"b": "READY standby"}, absent=["publish healing", "drain b"]),
    Row("SIGKILL of the standby: replaced, the primary's traffic untouched",
        [("exit", "b"), ("exit read", "b", -9), ("wait", 0.2), ("launched", "b"), ("ready", "b")],
        ["fence b", "publish b EXITED", "start b via spawn", "publish recovered"],
        {"a": "READY primary", "b": "READY standby"}, absent=["publish failover", "promote b epoch 2", "hold"]),
    Row("both killed: requests held, then the first engine back serves as that failover",
        [("exit", "b"), ("exit", "a"), ("exit read", "a", -9), ("exit read", "b", -9), ("wait", 0.2),
         ("launched", "a"), ("launched", "b"), ("ready", "b")],
        ["fence b", "fence a", "hold", "start a via spawn", "publish failover", "promote b epoch 2"],
        {"b": "READY primary", "a": "STARTING standby"}),
    Row("SIGSTOP of the primary: no heartbeat for heartbeat_timeout_s is a hang; fenced and failed over",
        [("heartbeat", "a", 1), ("heartbeat", "b", 1), ("wait", 1.0), ("heartbeat", "b", 1), ("wait", 0.6)],
        ["publish a FAILED", "fence a", "publish failover", "promote b epoch 2"], {"a": "FAILED standby"}),
    Row("failing probes of an idle primary fail it over (probe_failures in a row)",
        [("wait", 0.6), ("health", "a", "HTTP 500: boom"), ("wait", 0.6), ("health", "a", "HTTP 500: boom")],
        ["probe a health", "probe a health", "publish a FAILED", "fence a", "publish failover"],
        {"b": "READY primary"}),
    Row("probes the supervisor could not make (out of descriptors: EMFILE) never fail the primary over",
        [("wait", 0.6), ("health not made", "a", "OSError: [Errno 24]"), ("wait", 0.6),
         ("health not made", "a", "OSError: [Errno 24]"), ("wait", 0.6), ("health not made", "a", "ConnectError")],
        ["probe a health", "probe a health", "probe a health"], {"a": "READY primary", "b": "READY standby"},
        absent=["publish a FAILED", "fence a", "publish failover"], options={"heartbeat_timeout_s": 1e6}),
    Row("nor do a daemon's status requests the supervisor could not make",
        [("wait", 2.0), ("ping not made", "daemon-rank0"), ("wait", 2.0), ("ping not made", "daemon-rank0"),
         ("wait", 2.0), ("ping not made", "daemon-rank0"), ("wait", 2.0), ("ping not made", "daemon-rank0")],
        ["probe daemon-rank0 ping"], {"daemon-rank0": "READY"},
        absent=["publish daemon-rank0 FAILED", "fence daemon-rank0"], options={"heartbeat_timeout_s": 1e6}),
    Row("a primary whose long streams fill every slot (it steps, nothing finishes) is not probed",
        [("stepping", "a", 5), ("wait", 0.6), ("health", "a", None), ("stepping", "a", 40), ("wait", 0.6),
         ("stepping", "a", 90), ("wait", 0.6)], ["probe a health"],
        {"a": "READY primary"}, counts={"probe a health": 1}),
    Row("a probe left unanswered while the primary stepped (queued behind full slots) is not a failure",
        [("stepping", "a", 5), ("wait", 0.6), ("stepping", "a", 6), ("health", "a", "no whole answer within 5s"),
         ("wait", 0.6), ("stepping", "a", 7), ("health", "a", "no whole answer within 5s")],
        ["probe a health"], {"a": "READY primary", "b": "READY standby"}, counts={"publish failover": 0}),
    Row("a primary that served since its last probe is not probed (progress under load = healthy)",
        [("heartbeat", "a", 5), ("wait", 0.6), ("health", "a", None), ("heartbeat", "a", 9), ("wait", 0.6),
         ("heartbeat", "a", 12), ("wait", 0.6)], ["probe a health"],
        {"a": "READY primary"}, counts={"probe a health": 1}),
    Row("a canary mismatch is never promoted: FAILED, fenced, restarted",
        [("exit", "b"), ("exit read", "b", -9), ("wait", 0.2), ("launched", "b"),
         ("mismatch", "b", "canary mismatch: expected ' x', got ' y'")],
        ["publish canary_mismatch", "publish b FAILED", "fence b"], {"a": "READY primary", "b": "FAILED standby"},
        absent=["promote b epoch 2"]),
    Row("non-finite logits at the canary: never promoted",
        [("exit", "b"), ("exit read", "b", -9), ("wait", 0.2), ("launched", "b"), ("broken", "b", "HTTP 500: nan")],
        ["publish canary_mismatch", "publish b FAILED"], {"b": "FAILED standby"}),
    Row("an engine still starting is asked again: HTTP first, then the canary",
        [("exit", "b"), ("exit read", "b", -9), ("wait", 0.2), ("launched", "b"), ("not listening", "b"),
         ("wait", 0.05), ("unanswered", "b"), ("wait", 0.2), ("ready", "b")],
        ["probe b ready", "probe b ready", "publish b WARMING", "probe b ready", "publish b READY"],
        {"b": "READY standby"}),
    Row("an engine that says it serves is asked at once, not at the next poll (READY_POLL_S later)",
        [("exit", "b"), ("exit read", "b", -9), ("wait", 0.2), ("launched", "b"), ("not listening", "b"),
         ("said", "b", "state", {"state": "SERVING"})],
        ["probe b ready", "probe b ready"], {"b": "STARTING standby"}, counts={"probe b ready": 2}),
    Row("not READY within startup_timeout_s: FAILED and restarted",
        [("exit", "b"), ("exit read", "b", -9), ("wait", 0.2), ("launched", "b"), ("wait", 61)],
        ["publish b FAILED", "fence b"], {"b": "FAILED standby"}),
    # ---- daemons and the spawn server
    Row("a killed daemon is restarted while the engines serve from their mappings",
        [("exit", "daemon-rank0"), ("exit read", "daemon-rank0", -9), ("wait", 0.2), ("launched", "daemon-rank0"),
         ("daemon loading", "daemon-rank0"), ("wait", 0.1), ("daemon ready", "daemon-rank0")],
        ["fence daemon-rank0", "publish daemon-rank0 EXITED", "measure daemon-rank0 resident",
         "publish daemon-rank0 BACKOFF", "start daemon-rank0", "probe daemon-rank0 status", "publish daemon-rank0 READY"],
        {"daemon-rank0": "READY", "a": "READY primary"}, absent=["publish failover", "hold"]),
    Row("a hung daemon (3 pings unanswered) is fenced and restarted",
        [("wait", 2.0), ("ping", "daemon-rank0", False), ("wait", 2.0), ("ping", "daemon-rank0", False),
         ("wait", 2.0), ("ping", "daemon-rank0", False), ("exit", "daemon-rank0"),
         ("exit read", "daemon-rank0", -9)],
        ["probe daemon-rank0 ping", "publish daemon-rank0 FAILED", "fence daemon-rank0",
         "publish daemon-rank0 BACKOFF", "start daemon-rank0"], {"daemon-rank0": "STARTING"}),
    Row("the spawn server dies: engines live on, a new one takes the next spawn",
        [("exit", "spawn-server"), ("exit read", "spawn-server", -9), ("exit", "b"), ("exit read", "b", -9),
         ("wait", 0.2), ("launched", "spawn-server"), ("ping", "spawn-server", True), ("launched", "b")],
        ["fence spawn-server", "reap spawn-server", "start spawn-server", "start b via spawn"],
        {"spawn-server": "READY", "a": "READY primary", "b": "STARTING standby"}, absent=["start b via direct"]),
    Row("no spawn server within spawn_wait_s: the engine starts directly",
        [("exit", "spawn-server"), ("exit read", "spawn-server", -9), ("exit", "b"), ("exit read", "b", -9),
         ("wait", 0.2), ("wait", 31)],
        ["start spawn-server", "start b via direct"], {"b": "STARTING standby"}),
    # ---- backoff and FATAL
    Row("an extra slot that flaps goes FATAL while another engine serves",
        [("exit", "b"), ("exit read", "b", 1), ("wait", 0.2), ("launched", "b"), ("exit", "b"), ("exit read", "b", 1)],
        ["publish b BACKOFF", "start b via spawn", "publish b FATAL", "publish fatal"],
        {"b": "FATAL standby", "a": "READY primary"}, options={"flap_max": 2}),
    Row("a FATAL extra slot is tried once again after fatal_retry_s, and serves as standby again",
        [("exit", "b"), ("exit read", "b", 1), ("wait", 0.2), ("launched", "b"), ("exit", "b"), ("exit read", "b", 1),
         ("wait", 299), ("wait", 2), ("launched", "b"), ("ready", "b")],
        ["publish b FATAL", "publish fatal", "publish fatal_retry", "publish b STARTING", "start b via spawn",
         "publish b READY"],
        {"b": "READY standby", "a": "READY primary"}, counts={"publish fatal_retry": 1},
        options={"flap_max": 2, "fatal_retry_s": 300.0, "heartbeat_timeout_s": 1e6}),
    Row("a slow retry that fails is FATAL again at once: one try per fatal_retry_s",
        [("exit", "b"), ("exit read", "b", 1), ("wait", 0.2), ("launched", "b"), ("exit", "b"), ("exit read", "b", 1),
         ("wait", 301), ("launched", "b"), ("exit", "b"), ("exit read", "b", 1), ("wait", 200)],
        ["publish b FATAL", "publish fatal_retry", "start b via spawn", "publish b FATAL"],
        {"b": "FATAL standby"}, counts={"publish fatal_retry": 1, "publish b BACKOFF": 1},
        options={"flap_max": 2, "fatal_retry_s": 300.0, "heartbeat_timeout_s": 1e6}),
    Row("fatal_retry_s null: a FATAL slot waits for an admin restart",
        [("exit", "b"), ("exit read", "b", 1), ("wait", 0.2), ("launched", "b"), ("exit", "b"), ("exit read", "b", 1),
         ("wait", 3600)], ["publish b FATAL"], {"b": "FATAL standby"}, absent=["publish fatal_retry"],
        options={"flap_max": 2, "fatal_retry_s": None, "heartbeat_timeout_s": 1e6}),
    Row("the last engine standing is retried with capped backoff forever (a crash loop, never FATAL)",
        [("exit", "a"), ("exit read", "a", 1), ("wait", 0.2), ("launched", "a"), ("exit", "a"),
         ("exit read", "a", 1), ("wait", 0.3), ("launched", "a"), ("exit", "a"), ("exit read", "a", 1)],
        ["publish a BACKOFF", "start a via spawn", "publish a BACKOFF", "start a via spawn", "publish a BACKOFF"],
        {"a": "BACKOFF standby"}, absent=["publish a FATAL"], options={"engines": ("a",), "flap_max": 2}),
    Row("a boot error (exit 3) of the last engine of a node that served is retried until fixed",
        [("exit", "a"), ("exit read", "a", 3), ("wait", 0.2), ("launched", "a"), ("ready", "a")],
        ["publish a BACKOFF", "start a via spawn", "publish a READY", "promote a epoch 2"],
        {"a": "READY primary"}, absent=["publish a FATAL"], options={"engines": ("a",)}),
    # ---- admin and drain
    Row("admin promote: planned switchover, the old primary drains and comes back as standby",
        [("ask", "promote"), ("ask", "promote"), ("exit", "a"), ("exit read", "a", 0), ("launched", "a"),
         ("ready", "a")],
        ["publish failover", "drain a", "answer 200", "promote b epoch 2", "answer 409", "publish a STOPPED",
         "start a via spawn", "publish a READY"],
        {"a": "READY standby", "b": "READY primary"}),
    Row("a primary that dies before the drain of an admin promote reaches it: a crash, counted as a failure",
        [("ask", "promote"), ("exit", "a"), ("exit read", "a", 1), ("launched", "a")],
        ["publish failover", "drain a", "promote b epoch 2", "publish a STOPPED", "start a via spawn"],
        {"a": "STARTING standby", "b": "READY primary"}),
    Row("an engine SIGKILLed by us after drain_timeout_s is not a crash",
        [("ask", "restart", "b"), ("wait", 11), ("exit", "b"), ("exit read", "b", -9), ("launched", "b")],
        ["drain b", "fence b", "publish b STOPPED", "start b via spawn"], {"b": "STARTING standby"}),
    Row("admin restart of the standby: drained and started again",
        [("ask", "restart", "b"), ("exit", "b"), ("exit read", "b", 0), ("launched", "b"), ("ready", "b")],
        ["drain b", "answer 200", "publish b STOPPED", "start b via spawn", "publish b READY"],
        {"b": "READY standby", "a": "READY primary"}, absent=["publish failover"]),
    Row("admin restart of the primary: switched over first",
        [("ask", "restart", "a")], ["publish failover", "drain a", "answer 200", "promote b epoch 2"],
        {"b": "READY primary"}),
    Row("restart of the primary without a READY standby needs force; then requests are held",
        [("exit", "b"), ("ask", "restart", "a"), ("ask", "restart", "a", True), ("exit", "a"),
         ("exit read", "a", 0)],
        ["answer 409", "drain a", "answer 200", "fence a", "hold", "start a via spawn"],
        {"a": "STARTING standby"}),
    Row("node drain and undrain: /readyz flips, requests are still routed",
        [("ask", "drain"), ("ask", "undrain")],
        ["publish drained", "answer 200", "router drained", "publish drained", "answer 200", "router"],
        {"a": "READY primary"}, absent=["hold"]),
    Row("an unknown engine cannot be restarted", [("ask", "restart", "zzz")], ["answer 404"]),
    Row("SIGTERM: engines drain, then the spawn server and the daemons stop, then finish",
        [("stop", "SIGTERM"), ("exit", "a"), ("exit", "b"), ("exit", "spawn-server"), ("exit", "daemon-rank0")],
        ["notify stopping", "stop spawn-server", "drain a", "drain b", "router stopping", "fence a", "fence b",
         "stop daemon-rank0", "fence daemon-rank0", "finish 0"],
        {"a": "STOPPED standby", "daemon-rank0": "STOPPED"}, absent=["publish failover", "hold"]),
    Row("an engine still draining after drain_timeout_s is SIGKILLed",
        [("ask", "restart", "b"), ("wait", 11)], ["drain b", "fence b"], {"b": "DRAINING standby"}),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_decisions(row: Row) -> None:
    options = dict(row.options)
    engines = options.pop("engines", ("a", "b"))
    p = serving(engines, **options)
    got = p.play(*row.events)
    assert in_order(got, row.actions), f"\nwanted in order: {row.actions}\ngot: {got}"
    for brief in row.absent:
        assert brief not in got, f"{brief!r} in {got}"
    for brief, n in row.counts.items():
        assert got.count(brief) == n, (brief, got)
    for name, state in row.states.items():
        assert p.state(name) == state, (name, p.state(name), got)


def test_boot_order_daemons_and_spawn_server_first_then_the_engines_and_the_first_ready_serves() -> None:
    p = Play()
    got = p.play(*boot_steps())
    assert in_order(got, ["sweep links", "start daemon-rank0", "start spawn-server", "probe daemon-rank0 status",
                          "probe spawn-server ping", "start a via spawn", "start b via spawn", "probe a ready",
                          "publish a READY", "publish promoted", "notify ready", "promote a epoch 1",
                          "publish b READY"]), got
    assert got.index("start a via spawn") > got.index("publish daemon-rank0 READY")
    assert p.node.epoch == 1 and p.state("a") == "READY primary" and p.state("b") == "READY standby"


def test_boot_errors_of_every_slot_halt_instead_of_looping() -> None:
    p = Play(spawn_server=False, daemons=0)
    got = p.play(("launched", "a"), ("launched", "b"), ("exit", "a"), ("exit read", "a", 3), ("exit", "b"),
                 ("exit read", "b", 3), ("exit", "a"))
    assert got.count("start a via direct") == 1 and got.count("start b via direct") == 1, "each slot started once"
    assert in_order(got, ["publish a FATAL", "publish b FATAL", "notify boot failed", "notify stopping"]), got
    assert p.node.exit_code == 1 and "no engine could start (a, b, boot error exit code 3)" in \
        next(a.text for a in p.actions if a.brief() == "notify boot failed")


def test_a_daemon_that_dies_while_loading_is_a_boot_error_and_no_engine_starts() -> None:
    p = Play()
    got = p.play(("launched", "daemon-rank0"), ("exit", "daemon-rank0"), ("exit read", "daemon-rank0", 1))
    halt = next(a.text for a in p.actions if a.brief() == "notify boot failed")
    assert halt.startswith("daemon-rank0 stopped while loading the model (exit code 1): last log line")
    assert not any(b.startswith("start a") or b.startswith("start b") for b in got), got


def test_daemons_not_loaded_within_load_timeout_halt_the_boot() -> None:
    p = Play()
    p.play(("launched", "daemon-rank0"), ("wait", 601))
    assert "daemons not loaded after 600s" in next(a.text for a in p.actions if a.brief() == "notify boot failed")


def test_backoff_restarts_at_once_then_doubles_up_to_its_cap() -> None:
    p = serving(backoff_base_s=0.5, backoff_max_s=2.0)
    delays = []
    for _ in range(5):
        p.play(("exit", "b"), ("exit read", "b", 1))
        b = p.node.engines["b"]
        delays.append(round(b.retry_at - p.now, 2) if p.state("b").startswith("BACKOFF") else p.state("b"))
        p.play(("wait", 2.0), ("launched", "b"))
    assert delays == ["STARTING standby", 0.5, 1.0, 2.0, 2.0]  # (never READY in between)


def test_rollout_replaces_the_spawn_server_then_each_standby_then_switches_over() -> None:
    p = serving()
    got = p.play(("ask", "rollout"), ("exit", "spawn-server"), ("exit read", "spawn-server", 0),
                 ("launched", "spawn-server"), ("ping", "spawn-server", True),
                 ("exit", "b"), ("exit read", "b", 0), ("launched", "b"), ("ready", "b"),
                 ("exit", "a"), ("exit read", "a", 0), ("launched", "a"), ("ready", "a"))
    assert in_order(got, ["stop spawn-server", "start spawn-server", "drain b", "start b via spawn",
                          "publish b READY", "drain a", "promote b epoch 2", "start a via spawn", "publish a READY",
                          "answer 200"]), got
    assert p.answers()[-1] == (200, {"restarted": ["b", "a"], "primary": "b", "epoch": 2})


def test_a_standby_killed_while_the_rollout_replaces_the_spawn_server_waits_for_it() -> None:
    """Its new incarnation starts on the new spawn server (new code): the rollout waits for it
    instead of stopping it again while it starts (a SIGTERM then killed it: counted as a crash)."""
    p = serving()
    got = p.play(("ask", "rollout"), ("exit", "b"), ("exit read", "b", -9), ("wait", 0.2),
                 ("exit", "spawn-server"), ("exit read", "spawn-server", 0), ("launched", "spawn-server"),
                 ("ping", "spawn-server", True), ("launched", "b"), ("ready", "b"),
                 ("exit", "a"), ("exit read", "a", 0), ("launched", "a"), ("ready", "a"))
    assert in_order(got, ["start spawn-server", "start b via spawn", "publish b READY", "drain a",
                          "promote b epoch 2", "answer 200"]), got
    assert "stop b" not in got and "drain b" not in got
    assert not any("start failed" in e["reason"] for e in p.published("transition"))
    assert len(p.node.engines["b"].policy.failures) == 1  # the kill itself, nothing more
    assert p.answers()[-1] == (200, {"restarted": ["b", "a"], "primary": "b", "epoch": 2})


def test_an_engine_stopped_while_it_starts_dies_of_our_sigterm_and_that_is_no_crash() -> None:
    """Before its handler is installed SIGTERM kills an engine (-15): our doing, not a failure;
    any other death while it was asked to stop is one."""
    p = serving()
    p.play(("exit", "b"), ("exit read", "b", -9), ("launched", "b"))
    p.play(("ask", "restart", "b"), ("exit", "b"), ("exit read", "b", -15))  # (a restart resets the count)
    assert p.state("b") == "STARTING standby" and len(p.node.engines["b"].policy.failures) == 0
    p.play(("launched", "b"), ("ask", "restart", "b"), ("exit", "b"), ("exit read", "b", -11))
    assert len(p.node.engines["b"].policy.failures) == 1 and "a crash" in p.node.engines["b"].last_exit


def test_a_node_without_progress_is_stuck_once_and_fed_again_on_progress() -> None:
    p = serving(stuck_after_s=5.0)
    p.play(("exit", "a"), ("exit", "b"), ("exit read", "a", 3), ("exit read", "b", 3))  # both FATAL? no: served
    p.node.engines["a"].retry_at = p.node.engines["b"].retry_at = None  # (a start that never comes)
    got = p.play(("wait", 6))
    assert "notify stuck" in got and p.node.stuck
    assert "notify stuck" not in p.play(("wait", 6)), "said once"
    p.play(("said", "a", "phase", {"phase": "weights", "seconds": 1.0}))
    assert not p.node.stuck


def test_external_engines_are_started_by_their_command_and_stopped_by_sigterm() -> None:
    p = serving(external=True, spawn_server=False, daemons=0)
    assert p.state("a") == "READY primary"
    got = p.play(("exit", "a"), ("exit read", "a", 1), ("wait", 0.2), ("ask", "restart", "b"))
    assert in_order(got, ["fence a", "promote b epoch 2", "start a via external"]), got
    assert "stop b" not in got and p.answers()[-1][0] == 409  # b is the primary now, a not READY: force needed
    got = p.play(("launched", "a"), ("ready", "a"), ("ask", "restart", "b"))
    assert in_order(got, ["publish failover", "stop b", "promote a epoch 3"]), got  # SIGTERM: no control channel


def test_a_spawn_server_that_never_answers_is_a_boot_error() -> None:
    p = Play()
    p.play(("launched", "daemon-rank0"), ("daemon ready", "daemon-rank0"), ("launched", "spawn-server"),
           ("wait", 121), ("exit", "spawn-server"), ("exit read", "spawn-server", -9))
    halt = next(a.text for a in p.actions if a.brief() == "notify boot failed")
    assert halt.startswith("spawn server did not answer within 120s (killed by SIGKILL)"), halt


def test_a_crash_racing_an_admin_promote_is_recorded_as_a_crash_of_the_old_primary() -> None:
    """Without shared KV the switch is at once; the old primary's exit, asked to drain, says it had
    crashed: its slot counts the failure and says why (not 'stopped on request')."""
    p = serving()
    p.play(("ask", "promote"), ("exit", "a"), ("exit read", "a", -11))
    a = p.node.engines["a"]
    assert len(a.policy.failures) == 1 and "killed by SIGSEGV while asked to drain: a crash" in a.last_exit
    q = serving()
    q.play(("ask", "promote"), ("exit", "a"), ("exit read", "a", 0))  # the drain itself
    assert len(q.node.engines["a"].policy.failures) == 0


def test_a_fatal_slot_says_when_it_is_tried_again_in_status_and_why() -> None:
    from supervisor.admin.status_view import engine_view
    from supervisor.core.why import engine_why
    p = serving(flap_max=1, fatal_retry_s=300.0, heartbeat_timeout_s=1e6)
    p.play(("exit", "b"), ("exit read", "b", 1), ("wait", 100))
    b = p.node.engines["b"]
    view = engine_view(b, p.now)
    assert view["state"] == "FATAL" and 199 < view["next_try_in_s"] < 201 and view["fatal_retries"] == 0
    assert engine_why(b, p.now).startswith("engine b: FATAL (next try in 200 s): flapping: 1 failures")
    p.play(("wait", 201), ("launched", "b"))
    assert engine_view(b, p.now)["fatal_retries"] == 1 and p.published("fatal_retry")[-1]["attempt"] == 1
    p.play(("ready", "b"))
    assert engine_view(b, p.now)["fatal_retries"] == 0  # READY again: counted afresh


def test_engines_on_a_restarted_daemons_old_pool_move_onto_its_new_one_a_finished_rollout_or_not() -> None:
    """The standby on the old pool restarts onto the new one, then the primary hands over to it (a planned
    switchover) and restarts. A finished rollout stays on the node (its view in status): it blocked every
    healing after it (a second operator's review)."""
    from supervisor.core.model import Rollout
    p = serving(shared_kv=True)
    on = lambda pool: {"phases": {}, "weights_source": "cache_hit", "kv_source": "shared", "kv_pool_id": pool}  # noqa: E731
    p.play(("said", "a", "startup", on("p1")), ("said", "b", "startup", on("p1")))
    p.node.rollout = Rollout(0, [], started=0.0, running=False)
    got = p.play(("exit", "daemon-rank0"), ("exit read", "daemon-rank0", -9), ("wait", 0.3),
                 ("launched", "daemon-rank0"), ("wait", 0.2), ("daemon ready", "daemon-rank0", "p2"), ("wait", 0.2))
    assert in_order(got, ["publish daemon-rank0 READY", "publish healing", "drain b"]), got
    got = p.play(("exit", "b"), ("exit read", "b", 0), ("launched", "b"), ("ready", "b"),
                 ("said", "b", "startup", on("p2")), ("wait", 0.2))
    assert "tell a demote" in got, got
    assert [e["engine"] for e in p.published("healing")] == ["b", "a"]
