"""A whole node on one GPU (skipped without CUDA; run on the H200): daemon with the weights and the
shared KV pool in CUDA memory, primary and parked standby engines in client mode with CUDA graphs,
the CUDA heartbeat default (1 s). A SIGKILLed primary mid-stream: the stream is continued on the new
primary and ends whole; a SIGSTOPped primary is judged hung by the heartbeat default and failed
over; every replacement maps the resident weights again."""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
import torch

from harness.node import running

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONFIG = """
runtime_dir: {rt}
device: cuda
gpu_ids: [0]
model: {{path: {model}}}
engines: {{kv_cache_bytes: 268435456, max_num_seqs: 8, max_model_len: 512}}
failover: {{probe_interval_s: 1, hold_timeout_s: 30, backoff_base_s: 0.1, backoff_max_s: 1}}
router: {{port: 0}}
admin: {{port: 0}}
"""
TOKENS = 200


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("gpu-node")
    # each stream chunk paused 20 ms by the engines (test-only): a kill lands mid-stream
    with running(work, CONFIG.format(rt=work / "rt", model=tiny_model), ready_timeout_s=300,
                 env={"UNDERSTUDY_TEST_CHUNK_DELAY_S": "0.02"}) as h:
        h.model = tiny_model.name
        yield h


class Stream(threading.Thread):
    """A greedy stream of TOKENS tokens read on a thread: its chunks' text, [DONE], the usage."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.chunks: list[dict] = []
        self.done, self.error = False, None
        self.start()

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks.append(json.loads(line[6:]))
        except httpx.HTTPError as e:
            self.error = repr(e)

    def usage(self) -> dict:
        return next((c["usage"] for c in reversed(self.chunks) if c.get("usage")), {})


def test_the_node_runs_on_the_gpu_with_resident_weights_and_the_shared_pool(node):
    st = node.wait_all_ready(300)
    for e in st["engines"]:
        assert e["weights_source"] == "cache_hit" and e["kv_source"] == "shared", e
    assert sorted(e["kv_mode"] for e in st["engines"]) == ["parked", "writer"], st["engines"]
    (d,) = st["daemons"]
    assert d["state"] == "READY" and d["resident_bytes"] > 0
    assert st["model"]["device"] == "cuda"


def test_a_primary_sigkilled_mid_stream_is_failed_over_and_the_stream_ends_whole(node):
    st = node.wait_all_ready(120)
    old = next(e for e in st["engines"] if e["name"] == st["primary"])
    since = len(node.events)
    s = Stream(node.router_url, node.model)
    node.wait_for(lambda _: len(s.chunks) >= 10 or not s.is_alive(), 60, "ten chunks")
    assert s.is_alive(), (s.error, len(s.chunks))
    os.killpg(old["pid"], signal.SIGKILL)
    s.join(120)
    assert s.error is None and s.done, (s.error, s.chunks[-2:])
    assert s.usage().get("completion_tokens") == TOKENS, s.usage()
    fo = node.wait_event(lambda e: e["type"] == "failover" and e["from"] == old["name"], 30, since)
    assert fo["reason"] == "exit"
    node.wait_event(lambda e: e["type"] == "migration" and e["result"] == "continued", 30, since)
    st = node.wait_all_ready(300)
    back = next(e for e in st["engines"] if e["name"] == old["name"])
    assert back["incarnation"] == old["incarnation"] + 1 and back["weights_source"] == "cache_hit", back


def test_a_sigstopped_primary_is_judged_hung_by_the_cuda_heartbeat_default(node):
    """heartbeat_timeout_s null on CUDA: 1 s. The stopped primary is fenced (SIGKILL reaches a stopped
    process), the standby serves, the replacement comes back READY."""
    st = node.wait_all_ready(120)
    old = next(e for e in st["engines"] if e["name"] == st["primary"])
    since = len(node.events)
    os.killpg(old["pid"], signal.SIGSTOP)
    try:
        fo = node.wait_event(lambda e: e["type"] == "failover" and e["from"] == old["name"], 60, since)
    finally:
        try:
            os.killpg(old["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert fo["reason"] == "hang", fo
    r = httpx.post(node.router_url + "/v1/completions", timeout=60,
                   json={"model": node.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.headers["x-understudy-engine"] == fo["to"], r.text
    st = node.wait_all_ready(300)
    back = next(e for e in st["engines"] if e["name"] == old["name"])
    assert back["incarnation"] == old["incarnation"] + 1 and back["weights_source"] == "cache_hit", back
