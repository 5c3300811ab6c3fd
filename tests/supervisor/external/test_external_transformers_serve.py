"""A real third-party OpenAI server behind Understudy: `transformers serve` (transformers[serving], from PyPI,
pinned in constraints.txt) as both external engines, on the tiny checkpoint, on CPU, with continuous
batching (without it the server answers one request at a time: one stream would be mid-answer at a kill)
and a KV cache of 16k positions (unbounded, it sizes its cache from the host's memory: 14 GB here, and the
kernel's OOM killer ended it). READY with no
model.name (the canary uses the id the server reports: the folder's path), a SIGKILL of the primary with 8
streams and 8 plain requests in flight (0 failed, 0 cut, every continued stream the server's own greedy
continuation of the prompt plus the text it had sent), then a rollout, a drain and a restart under load.

Not skipped where the server cannot start: the test fails and says why. The failover's time is printed
(`-s`) and recorded in bench/RESULTS.md."""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.load import Load
from harness.node import Harness

from openai_stand_in import Stream

SERVE = Path(sys.executable).parent / "transformers"
CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines:
  kind: external
  count: 2
  external:
    command: "{serve} serve {{model}} --host 127.0.0.1 --port {{port}} --device cpu --continuous-batching --cb-num-blocks 512 --cb-block-size 32
      --log-level warning"
    env: {{HF_HUB_OFFLINE: "1", TOKENIZERS_PARALLELISM: "false", OMP_NUM_THREADS: "1"}}
failover: {{probe_interval_s: 1, probe_timeout_s: 60, hold_timeout_s: 60, startup_timeout_s: 300,
           drain_timeout_s: 60, stop_timeout_s: 10}}
router: {{port: 0}}
admin: {{port: 0}}
"""
PROMPTS = ["Once upon a time", "The quick brown fox", "Hello", "In the beginning", "A list:", "Dear Sir,",
           "Question: why?", "1, 2, 3,"]
M = 300  # tokens per answer: ~3 s for 16 at once here (continuous batching: all of them step together)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_transformers_serve_as_external_engines(tmp_path, tiny_model):
    assert SERVE.exists(), f"{SERVE} is missing: install the test extra (transformers[serving]): scripts/install"
    h = Harness(tmp_path, CONFIG.format(rt=tmp_path / "rt", model=tiny_model, serve=SERVE))
    try:
        h.wait_booted()
        h.wait_all_ready(300)
        log = h.tail(400)
        assert f"continuation: completions: replay by text, chat: not continued" in log, log[-3000:]
        assert f"model id {str(tiny_model)!r}" in log, "the id the server reports, with no model.name"
        ask = lambda body: httpx.post(h.router_url + "/v1/completions", json={"model": "tiny", "temperature": 0,
                                                                              **body}, timeout=300)
        alone = {p: ask({"prompt": p, "max_tokens": M}).json()["choices"][0]["text"] for p in PROMPTS}

        # --- a SIGKILL of the primary: 8 streams and 8 plain requests in flight
        old = h.primary()
        mark = len(h.events)
        streams = [Stream() for _ in PROMPTS]
        with httpx.Client() as client, ThreadPoolExecutor(16) as pool:
            url = h.router_url + "/v1/completions"
            body = lambda p, stream: {"model": "tiny", "prompt": p, "max_tokens": M, "temperature": 0, "stream": stream}
            reading = [pool.submit(s.read, client, url, body(p, True)) for s, p in zip(streams, PROMPTS)]
            plain = [pool.submit(client.post, url, json=body(p, False), timeout=300) for p in PROMPTS]
            deadline = time.monotonic() + 120
            while not all(len(s.texts) >= 2 for s in streams) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert all(len(s.texts) >= 2 for s in streams), [len(s.texts) for s in streams]
            in_flight = sum(not f.done() for f in plain)
            os.kill(old["pid"], signal.SIGKILL)
            for f in reading:
                f.result()
            answers = [f.result() for f in plain]
        ev = h.wait_event(lambda e: e["type"] == "failover", since=mark)
        assert ev["from"] == old["name"] and ev["reason"] == "exit"
        assert [r.status_code for r in answers] == [200] * 8, [r.text[:200] for r in answers]
        assert all(r.json()["choices"][0]["finish_reason"] for r in answers)
        cut = [(s.error, s.text) for s in streams if not s.whole]
        assert cut == [], cut
        moved = {e["request_id"]: e for e in h.events[mark:] if e["type"] == "migration"}
        assert all(e["result"] == "continued" for e in moved.values()), moved
        continued, same = 0, 0
        for s, p in zip(streams, PROMPTS):
            e = moved.get(next(iter(s.ids)))
            if e is None:  # (it had ended before the kill)
                assert s.text == alone[p]
                continue
            continued += 1
            sent, rest = "".join(s.texts[:e["chunks_before"]]), "".join(s.texts[e["chunks_before"]:])
            want = ask({"prompt": p + sent, "max_tokens": M - e["tokens_replayed"]}).json()["choices"][0]["text"]
            assert rest == want, (p, sent, rest, want)  # the server's own greedy continuation of what it had sent
            same += s.text == alone[p]
        seconds = re.search(r"^understudy_failover_seconds_sum (\S+)", h.metrics(), re.M)
        print(f"\ntransformers serve, SIGKILL of the primary with 8 streams and {in_flight} plain requests in flight: "
              f"0 failed, 0 cut; {continued} streams continued by text replay ({same} equal to the uninterrupted "
              f"run); failover (failure detected -> first answer of the new primary): "
              f"{float(seconds.group(1)) * 1e3:.0f} ms")
        h.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == old["name"], since=mark, timeout_s=300)
        h.wait_all_ready(300)

        # --- rollout, drain, restart under a light load
        with Load(h.router_url, "tiny", threads=2, max_tokens=8) as load:
            r = h.admin("POST", "/admin/rollout", timeout=600)
            assert r.status_code == 200, r.text
            assert h.admin("POST", "/admin/drain").status_code == 200
            rz = httpx.get(h.router_url + "/readyz")
            assert rz.status_code == 503 and rz.json()["reason"] == "node is drained"
            assert ask({"prompt": "Hi", "max_tokens": 2}).status_code == 200, "a drained node serves what arrives"
            assert h.admin("POST", "/admin/undrain").status_code == 200
            standby = h.standby()["name"]
            mark = len(h.events)
            assert h.admin("POST", f"/admin/engines/{standby}/restart").status_code == 200
            h.wait_event(lambda e: e.get("engine") == standby and e.get("to") == "READY", since=mark, timeout_s=300)
        assert load.failures == [] and len(load.results) > 0, load.failures[:5]
    finally:
        assert h.stop() == 0, h.tail()
