"""Re-adoption decisions without processes (supervisor/core/adoption_plan.py), the records file, and the
socket-activation handover (supervisor/effects/socket_activation.py, harness/handover.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from supervisor.core.records import ChildRecord, ChildRecords

from supervisor.effects.records_file import read_records, write_records
from supervisor.core.adoption_plan import Wanted, plan_adoption
from harness.handover import handover_argv
from supervisor.effects.socket_activation import ActivationError, inherited_sockets

WANT = Wanted(daemons={"daemon-rank0": "kd"}, engines={"a": "ke", "b": "ke"}, spawn_server="ks")


def rec(kind, name, pid, key, state="READY", inc=1, role=None, t=100.0):
    return ChildRecord(kind=kind, name=name, pid=pid, create_time=t, config_key=key, state=state, incarnation=inc,
                       role=role, port=9000 + pid, url=f"http://127.0.0.1:{9000 + pid}")


def full(primary="a", epoch=3, **over):
    children = [rec("daemon", "daemon-rank0", 10, "kd"), rec("spawn_server", "spawn-server", 11, "ks"),
                rec("engine", "a", 12, "ke", role="primary" if primary == "a" else "standby"),
                rec("engine", "b", 13, "ke", role="primary" if primary == "b" else "standby")]
    return ChildRecords(supervisor_pid=1, epoch=epoch, primary=primary, children=children, **over)


def alive(records, changes=None):
    obs = {c.pid: c.create_time for c in records.children}
    obs.update(changes or {})
    return obs


def test_everything_alive_and_matching_is_adopted_with_roles_and_epoch():
    r = full()
    plan = plan_adoption(r, alive(r), WANT)
    assert {c.name for c in plan.adopt} == {"daemon-rank0", "spawn-server", "a", "b"}
    assert plan.stop == [] and plan.gone == []
    assert plan.slots == {"daemon-rank0": "adopt", "a": "adopt", "b": "adopt", "spawn-server": "adopt"}
    assert (plan.primary, plan.epoch, plan.promoted) == ("a", 3, False)


def test_a_reused_pid_is_never_adopted_nor_killed():
    r = full()
    plan = plan_adoption(r, alive(r, {12: 250.0}), WANT)  # pid 12 now started at another time
    assert [c.name for c, _ in plan.gone] == ["a"] and "another process" in plan.gone[0][1]
    assert all(c.name != "a" for c, _ in plan.stop)
    assert plan.slots["a"] == "start"
    # the primary is gone: the adopted standby serves, as a failover (epoch + 1)
    assert (plan.primary, plan.epoch, plan.promoted) == ("b", 4, True)


def test_dead_children_are_forgotten_and_their_slots_started():
    r = full()
    plan = plan_adoption(r, alive(r, {10: None, 13: None}), WANT)
    assert sorted(c.name for c, _ in plan.gone) == ["b", "daemon-rank0"]
    assert plan.slots["daemon-rank0"] == "start" and plan.slots["b"] == "start" and plan.slots["a"] == "adopt"
    assert (plan.primary, plan.epoch) == ("a", 3)


def test_a_changed_config_or_a_removed_slot_stops_the_child():
    r = full()
    want = Wanted(daemons={"daemon-rank0": "kd2"}, engines={"a": "ke"}, spawn_server="ks")  # new model, no "b"
    plan = plan_adoption(r, alive(r), want)
    stopped = {c.name: why for c, why in plan.stop}
    assert set(stopped) == {"daemon-rank0", "b"}
    assert "another config" in stopped["daemon-rank0"] and "not in the config" in stopped["b"]
    assert plan.slots == {"daemon-rank0": "start", "a": "adopt", "spawn-server": "adopt"}


def test_children_caught_mid_start_or_failing_their_check_are_stopped():
    r = full()
    r.children[3] = rec("engine", "b", 13, "ke", state="WARMING", role="standby")
    plan = plan_adoption(r, alive(r), WANT, failed_checks={"a": "GET /health answered 503"})
    stopped = {c.name: why for c, why in plan.stop}
    assert "WARMING" in stopped["b"] and "503" in stopped["a"]
    assert plan.slots["a"] == plan.slots["b"] == "start"
    assert plan.primary is None and plan.epoch == 3  # nothing serves: the first READY engine is promoted


def test_an_older_duplicate_of_a_name_is_stopped():
    r = full()
    r.children.append(rec("engine", "b", 14, "ke", inc=0, role="standby"))
    plan = plan_adoption(r, alive(r), WANT)
    assert [c.pid for c in plan.adopt if c.name == "b"] == [13]
    assert [(c.pid, "older incarnation" in why) for c, why in plan.stop] == [(14, True)]


def test_no_records_means_start_everything():
    plan = plan_adoption(None, {}, WANT)
    assert plan.adopt == [] and set(plan.slots.values()) == {"start"} and plan.primary is None


def test_no_spawn_server_wanted_stops_a_recorded_one():
    r = full()
    plan = plan_adoption(r, alive(r), Wanted(WANT.daemons, WANT.engines, None))
    assert [c.name for c, _ in plan.stop] == ["spawn-server"] and "spawn-server" not in plan.slots


def test_records_round_trip_private_and_bad_files_are_ignored(tmp_path):
    write_records(tmp_path, full())
    path = tmp_path / "children.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_records(tmp_path) == full()
    path.write_text("{not json")
    assert read_records(tmp_path) is None
    path.write_text('{"version": 99, "supervisor_pid": 1}')
    assert read_records(tmp_path) is None
    path.unlink()
    assert read_records(tmp_path) is None


# ---- socket activation
def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def test_inherited_sockets_ignore_another_pid_and_clear_the_environment():
    env = {"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid() + 1)}
    assert inherited_sockets(env) == {} and env == {}


def test_inherited_sockets_refuse_what_is_not_a_listening_tcp_socket():
    env = {"LISTEN_FDS": "x", "LISTEN_PID": str(os.getpid())}
    with pytest.raises(ActivationError, match="LISTEN_FDS='x'"):
        inherited_sockets(env)
    env = {"LISTEN_FDS": "2", "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": "router"}
    with pytest.raises(ActivationError, match="names 1 fds"):
        inherited_sockets(env)


def test_handover_gives_the_child_fds_3_and_4_with_names(tmp_path):
    router, admin = _listener(), _listener()
    probe = ("import json, os, socket; from supervisor.effects.socket_activation import inherited_sockets;"
             "pid = os.environ['LISTEN_PID'] == str(os.getpid()); s = inherited_sockets();"
             "print(json.dumps([pid, {k: [v.fileno(), v.getsockname()[1]] for k, v in s.items()},"
             "'LISTEN_FDS' in os.environ]))")
    argv = handover_argv([router.fileno(), admin.fileno()], ["router", "admin"], [sys.executable, "-c", probe])
    out = subprocess.run(argv, pass_fds=[router.fileno(), admin.fileno()], capture_output=True, text=True,
                         timeout=30, cwd=os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
    assert out.returncode == 0, out.stderr
    import json
    same_pid, socks, leaked = json.loads(out.stdout)
    assert same_pid and not leaked
    assert socks == {"router": [3, router.getsockname()[1]], "admin": [4, admin.getsockname()[1]]}
    router.close()
    admin.close()
