"""The shared KV pool's writer role as the supervisor moves it (supervisor/core/kv_handover.py), as a
decision table: promotion is a round trip before the router switches, a planned switchover demotes
first, a dead writer's blocks are released (`fenced`) only once its exit is read; every failure of
the round trip ends with another engine serving or requests held, never with two writers."""
from __future__ import annotations

from decision_table import Play, in_order, serving
from supervisor.core.kv_handover import why_none

KV = {"shared_kv": True, "heartbeat_timeout_s": 60.0}  # (no hang detection while the clock jumps)
PROMOTED = ("said", "b", "promoted", {"adopted_blocks": 12, "quarantined_blocks": 1, "seconds": 0.004})


def test_boot_promotes_by_round_trip_before_any_request_is_routed() -> None:
    p = Play(**KV)
    got = p.play(("launched", "daemon-rank0"), ("daemon ready", "daemon-rank0"), ("launched", "spawn-server"),
                 ("ping", "spawn-server", True), ("launched", "a"), ("ready", "a"))
    assert "tell a promote" in got and "promote a epoch 1" not in got
    assert p.node.primary is None and p.node.promoting.name == "a"
    got = p.play(("said", "a", "promoted", {"adopted_blocks": 0}))
    assert in_order(got, ["publish promoted", "promote a epoch 1"]) and "tell a fenced" in got
    assert p.state("a") == "READY primary" and p.node.engines["a"].kv_writer


def test_a_killed_writer_is_replaced_by_round_trip_and_its_blocks_freed_once_reaped() -> None:
    p = serving(**KV)
    got = p.play(("exit", "a"))
    assert in_order(got, ["fence a", "tell b promote", "hold"]) and "promote b epoch 2" not in got
    got = p.play(PROMOTED)
    assert in_order(got, ["publish failover", "promote b epoch 2"]) and "tell b fenced" not in got  # a not reaped
    assert p.node.unfenced == {"a:1"}
    got = p.play(("exit read", "a", -9))
    assert "tell b fenced" in got and p.node.unfenced == set()
    assert p.published("failover")[-1]["to"] == "b"


def test_a_writer_reaped_before_the_promotion_ends_is_fenced_with_it() -> None:
    p = serving(**KV)
    p.play(("exit", "a"), ("exit read", "a", -9))
    got = p.play(PROMOTED)
    assert "promote b epoch 2" in got and "tell b fenced" in got


def test_a_hung_writer_being_fenced_is_not_taken_for_gone() -> None:
    """SIGSTOP of the primary: fenced (SIGKILL) and failed over at once, while its process may
    still exist: b hears `fenced` only once a's exit is read."""
    p = serving(shared_kv=True)  # (heartbeat_timeout_s 1.5)
    got = []
    for beat in range(2, 6):  # b beats, a has gone silent: a hang
        got += p.play(("wait", 0.5), ("heartbeat", "b", beat))
    assert in_order(got, ["fence a", "tell b promote"])
    got = p.play(PROMOTED)
    assert "promote b epoch 2" in got and "tell b fenced" not in got
    p.play(("exit", "a"))
    assert "tell b fenced" in p.play(("exit read", "a", -9))


def test_a_promotion_that_fails_or_times_out_fails_the_engine_and_holds() -> None:
    p = serving(**KV)
    p.play(("exit", "a"))
    got = p.play(("said", "b", "promote_failed", {"error": "the pool's writer still runs"}))
    assert in_order(got, ["publish b FAILED", "fence b"]) and p.node.primary is None
    assert p.node.pending_failover.reason == "exit"  # the next READY engine serves as that failover
    q = serving(**KV)
    q.play(("exit", "a"))
    got = q.play(("wait", 6.0))
    assert in_order(got, ["publish b FAILED", "fence b"]) and "promotion failed" in q.node.engines["b"].reason


def test_a_planned_switchover_demotes_the_writer_first() -> None:
    p = serving(**KV)
    got = p.play(("ask", "promote"))
    assert in_order(got, ["tell a demote", "answer 200"]) and "hold" in got and "promote b epoch 2" not in got
    got = p.play(("said", "a", "demoted", {"handed_off": 7}))
    assert in_order(got, ["tell b promote", "drain a"])
    assert p.node.engines["a"].heartbeat["kv_mode"] == "parked"  # status says so before a's next heartbeat
    got = p.play(PROMOTED)
    assert p.node.engines["b"].heartbeat["kv_mode"] == "writer"
    assert in_order(got, ["promote b epoch 2"]) and p.state("b") == "READY primary"
    assert p.published("failover")[-1]["reason"] == "promote"


def test_a_primary_that_does_not_answer_demote_is_fenced_and_the_switchover_goes_on() -> None:
    """Fenced, not demoted: it may still be writing the pool, so b hears `fenced` only once a's exit
    (its whole group) has been read."""
    p = serving(**KV)
    p.play(("ask", "promote"))
    got = p.play(("wait", 6.0))
    assert in_order(got, ["fence a", "tell b promote"])
    got = p.play(PROMOTED, ("exit", "a"))
    assert "promote b epoch 2" in got and "tell b fenced" not in got and p.node.unfenced == {"a:1"}
    assert "tell b fenced" in p.play(("exit read", "a", -9))


def test_a_second_switchover_while_one_is_under_way_is_refused() -> None:
    p = serving(**KV)
    p.play(("ask", "promote"))
    p.play(("ask", "promote"))
    assert p.answers()[-1][0] == 409 and "under way" in p.answers()[-1][1]["error"]


def test_without_shared_kv_promotion_is_at_once() -> None:
    p = serving()
    got = p.play(("exit", "a"))
    assert "promote b epoch 2" in got and not any(g.startswith("tell") for g in got)


def test_the_rollout_waits_for_the_switchover_round_trip() -> None:
    p = serving(**KV)
    p.play(("ask", "rollout"), ("exit", "spawn-server"), ("exit read", "spawn-server", 0), ("wait", 0.6),
           ("launched", "spawn-server"), ("ping", "spawn-server", True))  # a new spawn server first
    got = p.play(("exit", "b"), ("exit read", "b", 0), ("wait", 0.2), ("launched", "b"), ("ready", "b"))  # then b
    assert "tell a demote" in got and p.node.rollout.running
    got = p.play(("said", "a", "demoted", {"handed_off": 0}), PROMOTED)
    assert in_order(got, ["tell b promote", "promote b epoch 2"])


def test_a_primary_that_crashes_before_it_answers_demote_is_a_failover_for_its_exit() -> None:
    """Issue 23: a crash 22 ms before an admin promote was recorded as a planned promote. The crash
    decides: reason exit (during a promote), its exit restarts it with backoff (a failure counted)."""
    p = serving(**KV)
    p.play(("ask", "promote"))
    got = p.play(("exit", "a"))
    assert in_order(got, ["fence a", "publish a EXITED", "reap a", "tell b promote"]) and "drain a" not in got
    got = p.play(PROMOTED)
    ev = p.published("failover")[-1]
    assert (ev["reason"], ev["during"], ev["from"], ev["to"]) == ("exit", "promote", "a", "b"), ev
    assert "promote b epoch 2" in got
    got = p.play(("exit read", "a", -9))
    assert "publish a BACKOFF" in got and len(p.node.engines["a"].policy.failures) == 1
    assert p.answers()[0][0] == 200  # the switchover asked for did happen


def test_an_answered_demote_is_still_a_planned_promote() -> None:
    p = serving(**KV)
    p.play(("ask", "promote"), ("said", "a", "demoted", {"handed_off": 0}), PROMOTED)
    ev = p.published("failover")[-1]
    assert ev["reason"] == "promote" and "during" not in ev


def test_a_crash_during_a_switchover_stays_one_even_when_its_promotion_fails() -> None:
    """The failover that ends with another engine serving is still recorded as the crash during a
    promote (the detail travels with the pending failover)."""
    p = serving(**KV)
    p.play(("ask", "promote"), ("exit", "a"))
    p.play(("said", "b", "promote_failed", {"error": "the pool's writer still runs"}))
    assert p.node.primary is None and p.node.pending_failover.detail == {"during": "promote"}
    p.play(("exit read", "a", -9), ("wait", 0.2), ("launched", "a"), ("ready", "a"))
    p.play(("said", "a", "promoted", {"adopted_blocks": 3}))
    ev = p.published("failover")[-1]
    assert (ev["reason"], ev.get("during"), ev["from"], ev["to"]) == ("exit", "promote", "a", "a"), ev


def test_a_steps_continuations_are_one_event_and_a_malformed_report_none() -> None:
    """The new primary reports the continued requests of a step in one message (engines/core/engine.py
    `_report_continued`): one event for the status page and the bench, one item per request; a
    report that is not [[reused, recomputed], ...] of counts is dropped, not published."""
    p = serving(**KV)
    p.play(("said", "a", "continuations", {"each": [[48, 3], [96, 16]]}))
    assert p.published("continuations") == [{"type": "continuations", "engine": "a", "reused": [48, 96],
                                              "recomputed": [3, 16]}]
    for bad in ([[1]], [["1", 2]], [[1, -2]], "x", None, [[True, 1]]):
        p.play(("said", "a", "continuations", {"each": bad}))
    assert len(p.published("continuations")) == 1


def test_a_promotion_that_adopted_nothing_says_why(caplog) -> None:  # noqa: ANN001
    p = Play(**KV)
    p.play(("launched", "daemon-rank0"), ("daemon ready", "daemon-rank0"), ("launched", "spawn-server"),
           ("ping", "spawn-server", True), ("launched", "a"), ("ready", "a"))
    with caplog.at_level("INFO", logger="understudy"):
        p.play(("said", "a", "promoted", {"kv_mode": "writer"}),
               ("said", "a", "adopted", {"adopted_blocks": 0, "index_reset": "block 9 is SEALED with a bad checksum"}))
    line = next(r.getMessage() for r in caplog.records if "keyed blocks adopted" in r.getMessage())
    assert "0 keyed blocks adopted (the pool's index was rejected: block 9 is SEALED with a bad checksum" in line
    assert why_none({"adopted_blocks": 0, "kv_mode": "writer"}).startswith(" (the pool held no keyed block")
    assert "own KV cache" in why_none({"adopted_blocks": 0, "kv_mode": "own"})
    assert why_none({"adopted_blocks": 3}) == ""


def test_the_pool_read_after_the_answer_is_published_and_measured_apart() -> None:
    """`promoted` comes once the role is taken (the router switches then); `adopted`, once the engine
    has read the pool, only reports: published as `kv_adopted`, it changes no role or route."""
    p = serving(**KV)
    p.play(("exit", "a"))
    p.play(("said", "b", "promoted", {"kv_mode": "writer", "pool_epoch": 2, "seconds": 0.0002}))
    assert p.published("failover")[-1]["promotion_s"] == 0.0002 and p.state("b") == "READY primary"
    got = p.play(("said", "b", "adopted", {"adopted_blocks": 12, "quarantined_blocks": 1, "tails": 0,
                                           "seconds": 0.006, "take_seconds": 0.0002}))
    assert "promote b epoch 2" not in got and p.state("b") == "READY primary"
    assert p.published("kv_adopted")[-1] == {"type": "kv_adopted", "engine": "b", "adopted_blocks": 12,
                                              "quarantined_blocks": 1, "tails": 0, "index_reset": None,
                                              "seconds": 0.006, "take_seconds": 0.0002}
