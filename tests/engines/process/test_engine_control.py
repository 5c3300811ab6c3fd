"""The zmq control channel against a real engine: states, phases, heartbeats (stuck loop), drain."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import zmq

from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess
from engines.process.startup import PHASES


class Router:
    """The supervisor's side: a ROUTER collecting (identity, message) pairs."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.msgs: list[tuple[bytes, dict]] = []

    def pump(self, seconds: float) -> list[dict]:
        """Receive for `seconds`; returns the messages that arrived."""
        got, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000)):
                ident, raw = self.sock.recv_multipart()
                msg = json.loads(raw)
                self.msgs.append((ident, msg))
                got.append(msg)
        return got

    def wait_for(self, pred, timeout: float = 30.0) -> dict:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        for _, m in self.msgs:
            if pred(m):
                return m
        while time.monotonic() < deadline:
            for m in self.pump(0.05):
                if pred(m):
                    return m
        raise AssertionError(f"no matching control message in {timeout} s; got {[m for _, m in self.msgs][-5:]}")

    def command(self, identity: bytes, obj: dict) -> None:
        self.sock.send_multipart([identity, json.dumps(obj).encode()])


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-ctl")
    router = Router(f"ipc://{tmp}/control.sock")
    cfg = EngineConfig(name="ctl", model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                       control_endpoint=f"ipc://{tmp}/control.sock", incarnation=3, heartbeat_interval_s=0.1,
                       max_model_len=1024, max_num_seqs=4)
    proc = EngineProcess(cfg, tmp / "engine.log")
    proc.wait_ready(60)
    router.wait_for(lambda m: m["type"] == "state" and m["state"] == "SERVING")
    yield proc, router
    proc.signal_group(signal.SIGCONT)
    proc.stop(10)


def test_startup_states_and_phases_in_order(setup) -> None:
    proc, router = setup
    msgs = [m for _, m in router.msgs]
    assert {ident for ident, _ in router.msgs} == {b"ctl:3"}
    for m in msgs:
        assert (m["engine"], m["incarnation"], m["pid"]) == ("ctl", 3, proc.pid) and m["ts"] > 0
    states = [m["state"] for m in msgs if m["type"] == "state"]
    assert states == ["ATTACHING", "WARMING", "SERVING"]
    assert [m["phase"] for m in msgs if m["type"] == "phase"] == list(PHASES)
    weights = next(m for m in msgs if m["type"] == "phase" and m["phase"] == "weights")
    assert weights["source"] == "disk:off"
    startup = next(m for m in msgs if m["type"] == "startup")
    assert list(startup["phases"]) == list(PHASES) and startup["weights_source"] == "disk:off"
    serving = next(m for m in msgs if m["type"] == "state" and m["state"] == "SERVING")
    assert serving["port"] == proc.ready["port"]


def test_heartbeats_flow_and_stop_while_the_loop_is_stuck(setup) -> None:
    proc, router = setup
    beats = [m for m in router.pump(1.0) if m["type"] == "heartbeat"]
    assert len(beats) >= 5, beats
    assert {"steps", "running", "waiting", "served"} <= set(beats[-1])
    proc.signal_group(signal.SIGSTOP)
    try:
        router.pump(0.3)  # whatever was in flight before the stop
        stuck = [m for m in router.pump(1.5) if m["type"] == "heartbeat"]
    finally:
        proc.signal_group(signal.SIGCONT)
    assert stuck == []
    resumed = [m for m in router.pump(1.0) if m["type"] == "heartbeat"]
    assert len(resumed) >= 3


def test_drain_finishes_in_flight_refuses_new_and_exits_0(setup, tiny_model) -> None:
    proc, router = setup
    body = {"model": tiny_model.name, "prompt": "a long story", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}
    result: dict = {}

    def long_request() -> None:
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        result["status"], result["json"] = r.status_code, r.json()
    t = threading.Thread(target=long_request)
    t.start()
    router.wait_for(lambda m: m["type"] == "heartbeat" and m["running"] == 1)
    router.command(b"ctl:3", {"cmd": "drain"})
    router.wait_for(lambda m: m["type"] == "state" and m["state"] == "DRAINING", timeout=10)
    refused = httpx.post(proc.url + "/v1/completions", json={**body, "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    t.join(60)
    assert result["status"] == 200
    assert result["json"]["choices"][0]["finish_reason"] == "length"
    assert result["json"]["usage"]["completion_tokens"] == 1000
    assert proc.proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
