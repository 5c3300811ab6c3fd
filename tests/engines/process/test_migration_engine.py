"""The engine side of request continuation (a real engine process, tiny model, fp32):
`return_token_ids` on both endpoints, and a continuation from ANY chunk boundary of a stream
(prompt ids + the ids reported so far) emitting exactly the rest of the uninterrupted text."""
from __future__ import annotations

import json

import httpx
import pytest

from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess

MAX_LEN = 256
MODEL = "tiny-llama0"  # the tiny_model fixture's folder name


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-migration")
    cfg = EngineConfig(name="mig", model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                       weight_cache_mode="off", max_model_len=MAX_LEN, max_num_seqs=8)
    proc = EngineProcess(cfg, tmp / "engine.log")
    proc.wait_ready(60)
    yield proc
    proc.stop()


def stream(url: str, path: str, body: dict) -> tuple[list[dict], bool]:
    """Every data chunk of a stream, parsed, and whether it ended with [DONE]."""
    chunks, done = [], False
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return chunks, done


def text_of(chunks: list[dict], chat: bool) -> str:
    if chat:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def check_every_seam(url: str, path: str, body: dict, chat: bool) -> str:
    """Run `body` whole, then continue it from every chunk boundary: same text, finish and usage."""
    whole, done = stream(url, path, {**body, "return_token_ids": True, "stream_options": {"include_usage": True}})
    assert done
    plain, _ = stream(url, path, {**body, "stream_options": {"include_usage": True}})
    assert text_of(plain, chat) == text_of(whole, chat)
    assert all("token_ids" not in json.dumps(c) for c in plain), "ids only when asked for"
    prompt = whole[0]["prompt_token_ids"] if chat else whole[0]["choices"][0]["prompt_token_ids"]
    content = [c for c in whole if c["choices"] and (not chat or not c["choices"][0]["delta"].get("role"))]
    usage, finish = whole[-1]["usage"], content[-1]["choices"][0]["finish_reason"]
    assert sum(len(c["choices"][0]["token_ids"]) for c in content) == usage["completion_tokens"]
    assert len(prompt) == usage["prompt_tokens"]
    full = text_of(whole, chat)
    for k in range(len(content)):
        sent_ids = [t for c in content[:k] for t in c["choices"][0]["token_ids"]]
        cont, done = stream(url, path, {**body, "stream_options": {"include_usage": True},
                                        "continuation": {"prompt_token_ids": prompt,
                                                         "output_token_ids": sent_ids}})
        assert done
        rest = [c for c in cont if c["choices"] and (not chat or not c["choices"][0]["delta"].get("role"))]
        assert text_of(content[:k], chat) + text_of(rest, chat) == full, f"seam after chunk {k}"
        assert rest[-1]["choices"][0]["finish_reason"] == finish
        assert cont[-1]["usage"] == usage, f"usage after a seam at chunk {k}"
    return full


def test_greedy_completion_continues_from_every_chunk(engine):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    check_every_seam(engine.url, "/v1/completions", body, chat=False)


def test_seeded_sampled_completion_continues_from_every_chunk(engine):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 20, "temperature": 1.0,
            "top_p": 0.9, "seed": 4242, "ignore_eos": True}
    check_every_seam(engine.url, "/v1/completions", body, chat=False)


def test_stop_string_spanning_a_seam_is_still_found(engine):
    """A stop string picked from the middle of the greedy text: cut there, whatever the seam."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full, _ = stream(engine.url, "/v1/completions", body)
    text = text_of(full, chat=False)
    stop = text[len(text) // 2:len(text) // 2 + 5]
    assert len(stop.strip()) >= 2, text
    cut = check_every_seam(engine.url, "/v1/completions", {**body, "stop": [stop]}, chat=False)
    assert cut == text[:text.index(stop)]


def test_chat_with_stop_continues_from_every_chunk(engine):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24,
            "temperature": 0.8, "seed": 9, "ignore_eos": True}
    first, _ = stream(engine.url, "/v1/chat/completions", body)
    text = text_of(first, chat=True)
    stop = text[len(text) // 2:len(text) // 2 + 4]
    check_every_seam(engine.url, "/v1/chat/completions", {**body, "stop": [stop]}, chat=True)


def test_multibyte_text_continues_byte_identical(engine):
    """Hot sampling after a non-ASCII prompt emits byte tokens that split characters: the ids of a
    chunk are reported with it even when their character is still incomplete."""
    body = {"model": MODEL, "prompt": "日本語 naïve café ✓", "max_tokens": 24, "temperature": 1.6,
            "ignore_eos": True}
    for seed in range(6):
        full = check_every_seam(engine.url, "/v1/completions", {**body, "seed": seed}, chat=False)
        if any(ord(ch) > 127 for ch in full):
            return
    pytest.fail("no seed produced non-ASCII text: the multi-byte case was not exercised")


def test_non_streaming_token_ids_and_continuation(engine):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(engine.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60).json()
    ch = r["choices"][0]
    assert len(ch["token_ids"]) == 12 == r["usage"]["completion_tokens"]
    cont = httpx.post(engine.url + "/v1/completions", timeout=60, json={
        **body, "return_token_ids": True,
        "continuation": {"prompt_token_ids": ch["prompt_token_ids"], "output_token_ids": ch["token_ids"][:5]}})
    assert cont.status_code == 200
    # what it continued with is what the uninterrupted request went on with: the ids after the 5th,
    # and the text after the first five tokens' (a 5-token run of the same greedy request)
    head = httpx.post(engine.url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=60).json()
    rest = cont.json()["choices"][0]
    assert rest["token_ids"] == ch["token_ids"][5:]
    assert head["choices"][0]["text"] + rest["text"] == ch["text"] and rest["text"], (head, rest, ch["text"])
    plain = httpx.post(engine.url + "/v1/completions", json=body, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["text"] == ch["text"]
    assert cont.json()["usage"] == r["usage"]
    over = httpx.post(engine.url + "/v1/completions", timeout=60, json={
        **body, "continuation": {"prompt_token_ids": ch["prompt_token_ids"], "output_token_ids": ch["token_ids"]}})
    assert over.status_code == 400 and "leaves nothing to generate" in over.json()["error"]["message"]
    bad = httpx.post(engine.url + "/v1/completions", timeout=60, json={
        **body, "n": 2, "continuation": {"prompt_token_ids": [1, 2]}})
    assert bad.status_code == 400 and "continuation needs n=1" in bad.json()["error"]["message"]


def test_a_continuation_may_leave_its_prompt_out(engine):
    """The router sends a continuation without the client's prompt or messages (its ids are in
    `continuation.prompt_token_ids`): the same rest comes, for both endpoints; without a
    continuation (or with `continuation: null`) the prompt is still required, and the ids are still
    checked."""
    for path, body in (("/v1/completions", {"prompt": "Once upon a time"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                **body}
        whole = httpx.post(engine.url + path, json=body, timeout=60).json()
        ids = whole["choices"][0]["token_ids"]
        prompt_ids = whole["choices"][0].get("prompt_token_ids") or whole.get("prompt_token_ids")
        cont = {"prompt_token_ids": prompt_ids, "output_token_ids": ids[:3]}
        bare = {k: v for k, v in body.items() if k not in ("prompt", "messages")}
        with_prompt = httpx.post(engine.url + path, json={**body, "continuation": cont}, timeout=60)
        without = httpx.post(engine.url + path, json={**bare, "continuation": cont}, timeout=60)
        assert without.status_code == 200 == with_prompt.status_code, without.text
        assert without.json()["choices"][0]["token_ids"] == ids[3:] == with_prompt.json()["choices"][0]["token_ids"]
        assert httpx.post(engine.url + path, json={**body, "continuation": None}, timeout=60).status_code == 200
        missing = httpx.post(engine.url + path, json={**bare, "continuation": None}, timeout=60)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == \
            ("prompt" if "prompt" in body else "messages"), missing.text
        for token in (10 ** 9, -3, 2 ** 63 + 5):  # (past int64 too: refused, not an overflow inside the engine)
            bad = httpx.post(engine.url + path, timeout=60, json={**bare, "continuation": {
                "prompt_token_ids": prompt_ids, "output_token_ids": [5, token]}})
            err = bad.json()["error"]
            assert bad.status_code == 400 and f"token id {token} is outside the vocabulary" in err["message"], bad.text
    empty = httpx.post(engine.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [], "continuation": {"prompt_token_ids": [1, 2]}})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages", empty.text


def raw_events(url: str, path: str, body: dict) -> list[str]:
    """The events of a stream as sent (comments included), in order."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [e for e in r.read().decode().split("\n\n") if e]


def test_a_stream_with_token_ids_marks_the_moment_its_request_first_runs(engine):
    """Issue 23: the `: scheduled` comment (wire/sse.py SCHEDULED) tells the router the engine
    began running the request, not only queued it: once per stream asking for token ids, before its
    first token (a completion) or after the role chunk (chat), also in a continuation; never in a
    stream that did not ask for ids (its bytes stay OpenAI's)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    events = raw_events(engine.url, "/v1/completions", {**body, "return_token_ids": True})
    assert events.count(": scheduled") == 1 and events[0] == ": scheduled", events[:3]
    first = json.loads(events[1][6:])["choices"][0]
    cont = raw_events(engine.url, "/v1/completions", {**body, "return_token_ids": True, "continuation": {
        "prompt_token_ids": first["prompt_token_ids"], "output_token_ids": first["token_ids"]}})
    assert cont.count(": scheduled") == 1 and cont[0] == ": scheduled", cont[:3]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    events = raw_events(engine.url, "/v1/chat/completions", chat)
    assert '"role":"assistant"' in events[0] and events[1] == ": scheduled", events[:3]
    assert events.count(": scheduled") == 1
    for path, b in (("/v1/completions", body), ("/v1/chat/completions", {**chat, "return_token_ids": False})):
        assert not any(e.startswith(":") for e in raw_events(engine.url, path, b))
