"""Re-adoption as the first pass (supervisor/core/adoption.py), as a table: the records a dead
supervisor left, what is observed now, what the checks say; the actions and states the pass leads
to (test_supervisor_readopt and test_supervisor_external play the same with real processes; the
plan alone is tested in test_supervisor_reconcile)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from decision_table import Play, in_order, records

ALIVE = {10: 50.0, 11: 50.0, 12: 50.0, 13: 50.0}  # pid -> start time, as recorded


@dataclass
class Row:
    id: str
    observed: dict
    failed: dict
    actions: list[str]
    states: dict[str, str]
    absent: list[str] = field(default_factory=list)
    records: dict = field(default_factory=dict)  # records() keywords
    spawn_children: tuple = ()
    epoch: int = 3
    primary: str | None = "a"


ROWS = [
    Row("everything alive and matching: adopted with roles and epoch, nothing started",
        ALIVE, {}, ["survey", "check adoptable daemon-rank0 spawn-server a b", "attach spawn-server",
                    "attach daemon-rank0", "publish daemon-rank0 READY", "attach a", "publish a READY", "attach b",
                    "notify ready", "publish adopted", "promote a epoch 3"],
        {"a": "READY primary", "b": "READY standby", "daemon-rank0": "READY", "spawn-server": "READY"},
        absent=["start a via spawn", "start daemon-rank0", "publish failover", "await gone"]),
    Row("link sockets dead engines left are swept once adopted, but the live adopted engines', before any start",
        {**ALIVE, 12: None}, {}, ["attach b", "publish adopted", "sweep links but 13", "start a via spawn"],
        {"b": "READY primary", "a": "STARTING standby"}, epoch=4, primary="b"),
    Row("the recorded primary died with the supervisor: the standby serves, as a failover (epoch + 1)",
        {**ALIVE, 12: None}, {}, ["attach b", "publish failover", "publish adopted", "start a via spawn",
                                  "promote b epoch 4"],
        {"b": "READY primary", "a": "STARTING standby"}, epoch=4, primary="b"),
    Row("a pid now another process's is never touched, its slot started afresh",
        {**ALIVE, 13: 99.0}, {}, ["attach a", "publish adopted", "start b via spawn"],
        {"a": "READY primary", "b": "STARTING standby"}, absent=["fence b"]),
    Row("a child that fails its check is stopped, waited for, and started afresh",
        ALIVE, {"b": "GET /health answered 503"}, ["fence b", "publish adopted", "await gone", "start b via spawn"],
        {"a": "READY primary", "b": "STARTING standby"}),
    Row("a dead daemon is started again; the adopted engines keep serving meanwhile",
        {**ALIVE, 10: None}, {}, ["attach a", "attach b", "publish adopted", "start daemon-rank0"],
        {"a": "READY primary", "daemon-rank0": "STARTING"}, absent=["start a via spawn"]),
    Row("an engine the dead spawn server forked but nobody recorded is stopped",
        ALIVE, {}, ["fence pid 77", "publish adopted", "await gone"], {"a": "READY primary"}, spawn_children=(77, 12)),
    Row("an engine started with another config is stopped, not adopted; the daemon and spawn server are",
        ALIVE, {}, ["fence a", "attach daemon-rank0", "attach b", "publish adopted", "await gone", "start a via spawn"],
        {"b": "READY primary", "a": "STARTING standby", "daemon-rank0": "READY"}, epoch=4, primary="b",
        records={"changed": "a"}),
    Row("an operator's drain outlives the supervisor crash",
        ALIVE, {}, ["publish adopted", "router drained"], {"a": "READY primary"}, records={"drained": True}),
]


def test_a_failed_survey_gives_up_adoption_and_boots_afresh() -> None:
    p = Play(records=records())
    got = p.play(("survey failed", "PermissionError: /proc"))
    assert "start daemon-rank0" in got and "publish adopted" not in got and not any(g.startswith("attach") for g in got)


def test_a_failed_check_round_stops_every_recorded_child_still_alive_then_boots_afresh() -> None:
    p = Play(records=records())
    got = p.play(("surveyed", ALIVE), ("check failed", "RuntimeError: bug"), ("gone",))
    assert in_order(got, ["fence pid 10", "fence pid 11", "fence pid 12", "fence pid 13", "await gone",
                          "start daemon-rank0"]), got


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_first_pass(row: Row) -> None:
    p = Play(records=records(**row.records))
    got = p.play(("surveyed", row.observed, row.spawn_children), ("checked", row.failed), ("gone",))
    assert in_order(got, row.actions), f"\nwanted in order: {row.actions}\ngot: {got}"
    for brief in row.absent:
        assert brief not in got, (brief, got)
    for name, state in row.states.items():
        assert p.state(name) == state, (name, p.state(name), got)
    assert (p.node.epoch, p.node.primary) == (row.epoch, row.primary)
    assert p.node.phase in ("booting", "serving") and p.node.adoption is None
