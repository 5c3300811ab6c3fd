"""The engine's own listener: connection cap and request-head timeout (wire/guarded_http.py)."""
from __future__ import annotations

import select
import socket
import time

import httpx

from wire.engine_config import EngineConfig
from wire.guarded_http import ListenerLimits
from harness.engine_process import EngineProcess


def shut_by_peer(socks: list[socket.socket]) -> set[int]:
    """Which of ``socks`` (by index) the other end has closed or reset by now (no wait)."""
    ready, _, _ = select.select(socks, [], [], 0)
    shut = set()
    for s in ready:
        try:
            if s.recv(1, socket.MSG_PEEK) == b"":
                shut.add(socks.index(s))
        except ConnectionResetError:
            shut.add(socks.index(s))
    return shut


def wait_closed(socks: list[socket.socket], at_least: int, timeout_s: float = 60) -> set[int]:
    """Wait until at least ``at_least`` of ``socks`` are closed by the other end; which are."""
    deadline = time.monotonic() + timeout_s
    while len(shut := shut_by_peer(socks)) < at_least:
        assert time.monotonic() < deadline, f"only {len(shut)} of {len(socks)} closed: {sorted(shut)}"
        time.sleep(0.02)
    return shut


def test_engine_listener_caps_and_times_out_idle_connections(tiny_model, tmp_path):
    """20 idle connections against a cap of 5: those over the cap are closed on accept while those
    under it stay open; those are closed in turn when no request head came (header_timeout_s);
    then the engine serves."""
    cfg = EngineConfig(name="conn", model_path=str(tiny_model), port=0, runtime_dir=str(tmp_path / "rt"),
                       weight_cache_mode="off", max_model_len=128, max_num_seqs=4,
                       listener=ListenerLimits(max_connections=5, header_timeout_s=3.0))
    proc = EngineProcess(cfg, tmp_path / "engine.log")
    socks = []
    try:
        proc.wait_ready(60)
        port = proc.ready["port"]
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        refused = wait_closed(socks, 15)
        assert len(refused) < 20, "the connections under the cap were closed with the rest, not after"
        wait_closed(socks, 20)  # the rest: no request head within header_timeout_s
        r = httpx.post(proc.url + "/v1/completions", timeout=30,
                       json={"model": tiny_model.name, "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()
        assert proc.stop() == 0
