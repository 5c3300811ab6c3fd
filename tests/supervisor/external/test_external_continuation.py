"""External engines behind the router, with the stand-in of tests/openai_stand_in.py (a model whose answers
are known here): READY on the model id the engine reports (no model.name), streams continued across a
SIGKILL of the primary by the path the engine takes (token ids: the exact continuation; text: a replay,
exact for this model), a chat stream the engine cannot continue ended by an explicit error event, and bad
answers on /v1/models (garbage, none, never, a changed id) each said in one line, never READY with a wrong id."""
from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from harness.node import Harness

from openai_stand_in import STAND_IN, chat_prompt, kill_mid_stream, next_text

BASE = """
runtime_dir: {rt}
engines:
  kind: external
  count: 2
  external: {{command: "{command}", url: "http://127.0.0.1:{{port}}"}}
failover: {{probe_interval_s: 0.3, probe_timeout_s: 2, hold_timeout_s: 10, backoff_base_s: 0.05,
           backoff_max_s: 0.2, flap_max: {flap}, flap_window_s: 60, drain_timeout_s: 5, stop_timeout_s: 3}}
router: {{port: 0}}
admin: {{port: 0}}
"""
PROMPTS = ["Once upon a time", "The quick brown fox", "Hello", "A", "In the beginning", "zz", "Tokens:", "42"]
N = 48  # tokens per answer: ~1.4 s at the stand-in's 30 ms each


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    p = tmp_path_factory.mktemp("stand-in") / "stand_in.py"
    p.write_text(STAND_IN)
    return p


def node(tmp, script, mode: str, models: str = "id:stand-in/model-7b", flap: int = 50) -> Harness:
    command = f"{sys.executable} {script} {{port}} {{name}} {mode} {models} 0.03 {tmp / 'asked'}"
    return Harness(tmp, BASE.format(rt=tmp / "rt", command=command, flap=flap))


def asked(tmp, name: str) -> list[dict]:
    """What the stand-in named ``name`` was asked (one line per request)."""
    path = tmp / f"asked-{name}"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_token_ids_give_the_exact_continuation(tmp_path, script):
    """vLLM's shape: prompt ids + the ids already sent; completions and chat streams equal to an uninterrupted
    run, one response id each; READY on the id from /v1/models with no model.name anywhere."""
    h = node(tmp_path, script, "ids")
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        assert "continuation: completions: exact (token ids), chat: replay by text" in h.tail(200)
        bodies = [{"model": "whatever-the-client-says", "prompt": p, "max_tokens": N, "stream": True} for p in PROMPTS]
        chat = [{"role": "user", "content": "Tell me a story"}]
        bodies.append({"model": "m", "messages": chat, "max_tokens": N, "stream": True})
        old = h.primary()["name"]
        streams, ev = kill_mid_stream(h, bodies)
        for s, b in zip(streams, bodies):
            assert s.whole, (s.error, s.texts[-3:])
            want = next_text(b["prompt"] if "prompt" in b else chat_prompt(chat), N)
            assert s.text == want, (b, s.text, want)
        new = ev["to"]
        got = asked(tmp_path, new)
        continued = [a for a in got if a["path"] == "completions" and a["prompt"] == "ids" and a["max_tokens"] > 1]
        assert len(continued) == len(PROMPTS), got  # (max_tokens 1: what READY tried)
        assert any(a["path"] == "chat" and a["continued"] for a in got), got
        assert all(a["max_tokens"] < N for a in continued), "the tokens left, not N again"
        assert not any(a.get("prompt") == "ids" and a["max_tokens"] > 1 for a in asked(tmp_path, old))
        migrated = [e for e in h.events if e["type"] == "migration"]
        assert sum(e["result"] == "continued" for e in migrated) == len(bodies), migrated
    finally:
        assert h.stop() == 0, h.tail()


def test_a_replay_by_text_continues_completions_and_a_chat_it_cannot_continue_ends_explicitly(tmp_path, script):
    """transformers serve's shape (unknown fields refused, text prompts only): completions replayed by text
    (exact for this model: a character per token), plain requests too; a chat stream gets an error event."""
    h = node(tmp_path, script, "text")
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        assert "continuation: completions: replay by text, chat: not continued" in h.tail(200)
        bodies = [{"model": "x", "prompt": p, "max_tokens": N, "stream": True} for p in PROMPTS[:4]]
        bodies.append({"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": N, "stream": True})
        streams, ev = kill_mid_stream(h, bodies)
        for s, b in zip(streams[:4], bodies):
            assert s.whole and s.text == next_text(b["prompt"], N), (s.error, s.text)
        chat = streams[4]
        assert chat.error is not None and chat.error["type"] == "migration_failed" and \
            "does not continue a partial assistant message (continue_final_message)" in chat.error["message"], chat.error
        got = asked(tmp_path, ev["to"])
        replays = [a for a in got if a["path"] == "completions" and 8 < (a["max_tokens"] or 0) < N]  # (not the canary)
        assert len(replays) == 4, got
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "x", "prompt": "Hello", "max_tokens": 5},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == next_text("Hello", 5), r.text
    finally:
        assert h.stop() == 0, h.tail()


@pytest.mark.parametrize("models, line", [
    ("garbage", 'GET /v1/models answered no model list: expected {"data": [{"id": ...}]}, got \'<html>it works</html>\''),
    ("hang", "/v1/models did not answer: UpstreamTimeout"),
])
def test_an_engine_without_a_usable_model_id_is_never_ready(tmp_path, script, models, line):
    h = node(tmp_path, script, "text", models, flap=2)
    try:
        h.wait_booted()
        deadline = time.monotonic() + 60
        while line not in h.tail(400) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert line in h.tail(400), h.tail(40)
        st = h.status()
        assert st["primary"] is None and not any(e["state"] == "READY" for e in st["engines"]), st
    finally:
        assert h.stop() == 0, h.tail()


def test_an_engine_without_v1_models_serves_under_the_configured_name_and_says_so(tmp_path, script):
    h = node(tmp_path, script, "text", "none")
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        assert "the engine reports no model id (GET /v1/models: HTTP 404); requests name the model 'external'" \
            in h.tail(200), h.tail(40)
    finally:
        assert h.stop() == 0, h.tail()


def test_a_model_id_changed_across_a_restart_is_never_promoted(tmp_path, script):
    ids = tmp_path / "model-id"
    ids.write_text("org/model-a")
    h = node(tmp_path, script, "text", f"file:{ids}", flap=2)
    try:
        h.wait_booted()
        h.wait_all_ready(60)
        standby = h.standby()["name"]
        ids.write_text("org/model-b")  # the engine's next start serves another model
        mark = len(h.events)
        assert h.admin("POST", f"/admin/engines/{standby}/restart").status_code == 200
        ev = h.wait_event(lambda e: e["type"] == "canary_mismatch" and e["engine"] == standby, since=mark, timeout_s=60)
        assert ev["reason"] == ("model id changed: the engine reports 'org/model-b' on /v1/models, the node served "
                                "'org/model-a' (a restart must serve the same model)"), ev
        assert not any(e["type"] in ("failover", "promoted") for e in h.events[mark:])
        r = httpx.post(h.router_url + "/v1/completions", json={"model": "x", "prompt": "Hi", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "org/model-a"
    finally:
        assert h.stop() == 0, h.tail()
