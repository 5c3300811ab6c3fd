"""FP8 and Mixture-of-Experts checkpoints on a real node (issues 54, 55), CPU, float32: the daemon
holds the weights with their scales (stacked experts), both engines attach them and pass the
numerics check before READY, and a greedy stream whose primary is SIGKILLed mid-answer continues
on the standby with the uninterrupted text."""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from models.make_model import make_model
from harness.node import running
from tests.supervisor.router.test_migration_failover import CONFIG

GREEDY = {"model": "m", "prompt": "Once upon a time", "max_tokens": 14, "temperature": 0, "ignore_eos": True,
          "stream": True}
MODELS = {"fp8-block": dict(preset="tiny", quant="fp8-block"),
          "moe-fp8": dict(preset="moe-tiny", arch="mixtral", quant="fp8-block", block=32)}


@pytest.fixture(scope="module", params=list(MODELS))
def node(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(request.param)
    model = make_model(work / "model", seed=1, **MODELS[request.param])
    with running(work, CONFIG.format(rt=work / "rt", model=model),
                 env={"UNDERSTUDY_TEST_CHUNK_DELAY_S": "0.04"}) as h:
        yield h


def stream(url: str, chunks: list[str], got_some: threading.Event | None = None) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=GREEDY, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
                if got_some is not None and len(chunks) >= 4:
                    got_some.set()
            elif line == "data: [DONE]":
                chunks.append("[DONE]")


def test_quantized_weights_are_shared_and_checked_and_a_stream_survives_a_kill(node) -> None:
    node.wait_all_ready()
    for e in node.engines().values():
        assert e["weights_source"] == "cache_hit", e
    log = (node.workdir / "rt" / "logs").glob("a-*.log")
    assert any("numerics against float32 PyTorch: layer 0 attention" in p.read_text() for p in log)
    ref: list[str] = []
    stream(node.router_url, ref)
    assert ref[-1] == "[DONE]" and "".join(ref[:-1])
    victim = node.primary()
    got: list[str] = []
    some = threading.Event()
    t = threading.Thread(target=stream, args=(node.router_url, got, some), daemon=True)
    t.start()
    assert some.wait(30)
    os.killpg(victim["pid"], signal.SIGKILL)
    t.join(60)
    assert got == ref
    node.wait_event(lambda e: e["type"] == "migration" and e["result"] == "continued", timeout_s=30)


def test_a_rollout_under_load_fails_nothing(node) -> None:
    """Both engines restarted in turn (each back on the daemon's weights), streams going through."""
    node.wait_all_ready()
    results: list[list[str]] = []

    def load() -> None:
        for _ in range(6):
            chunks: list[str] = []
            stream(node.router_url, chunks)
            results.append(chunks)
    t = threading.Thread(target=load, daemon=True)
    t.start()
    before = {e["name"]: e["incarnation"] for e in node.engines().values()}
    r = node.admin("POST", "/admin/rollout", timeout=300)
    assert r.status_code == 200, r.text
    t.join(120)
    assert results and all(c and c[-1] == "[DONE]" for c in results), results
    after = node.wait_all_ready()
    assert all(e["incarnation"] > before[e["name"]] and e["weights_source"] == "cache_hit"
               for e in node.engines().values()), after
