"""The engine's own listener: connection cap and request-head timeout (engines/guarded_http.py)."""
from __future__ import annotations

import socket
import time

import httpx

from engines.config import EngineConfig
from engines.guarded_http import ListenerLimits
from harness.engine_process import EngineProcess
from harness.node import closed_by_peer


def test_engine_listener_caps_and_times_out_idle_connections(tiny_model, tmp_path):
    cfg = EngineConfig(name="conn", model_path=str(tiny_model), port=0, runtime_dir=str(tmp_path / "rt"),
                       weight_cache_mode="off", max_model_len=128, max_num_seqs=4,
                       listener=ListenerLimits(max_connections=5, header_timeout_s=1.0))
    proc = EngineProcess(cfg, tmp_path / "engine.log")
    socks = []
    try:
        proc.wait_ready(60)
        port = proc.ready["port"]
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        time.sleep(0.3)
        refused = sum(closed_by_peer(s, 0.05) for s in socks)
        assert refused >= 15, refused  # over the cap of 5: closed on accept
        time.sleep(1.2)
        assert all(closed_by_peer(s, 0.5) for s in socks)  # the rest: no request head within 1 s
        r = httpx.post(proc.url + "/v1/completions", timeout=30,
                       json={"model": tiny_model.name, "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()
        assert proc.stop() == 0
