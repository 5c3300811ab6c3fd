"""A real engine process (weights `off`) through the official `openai` client and raw HTTP; bad input."""
from __future__ import annotations

import json
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess
from engines.process.startup import PHASES
from engines.core.tokenizer import Tokenizer

MAX_LEN = 512
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-api")
    cfg = EngineConfig(name="api", model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                       weight_cache_mode="off", max_model_len=MAX_LEN, max_num_seqs=8)
    proc = EngineProcess(cfg, tmp / "engine.log")
    proc.wait_ready(60)
    yield proc
    assert proc.stop() == 0, "SIGTERM must drain and exit 0"


@pytest.fixture(scope="module")
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(tiny_model) -> str:
    return tiny_model.name


def greedy(client, model_name, prompt: str, n: int = 24, **kw) -> openai.types.Completion:
    return client.completions.create(model=model_name, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body=EXTRA, **kw)


def test_completion_non_streaming(client, model_name, tiny_model) -> None:
    r = greedy(client, model_name, "The quick brown fox")
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    prompt_tokens = len(Tokenizer(tiny_model).encode("The quick brown fox"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
           (prompt_tokens, 24, prompt_tokens + 24)


def test_completion_streaming_matches_non_streaming(client, model_name) -> None:
    full = greedy(client, model_name, "Once upon a time").choices[0].text
    chunks = list(greedy(client, model_name, "Once upon a time", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_chat_streaming_and_not(client, model_name) -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=16, temperature=0,
                                       extra_body=EXTRA)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    stream = list(client.chat.completions.create(model=model_name, messages=msgs, max_tokens=16, temperature=0,
                                                 extra_body=EXTRA, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_string_cuts_output_streaming_and_not(client, model_name) -> None:
    full = greedy(client, model_name, "In a hole in the ground", n=40).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    r = greedy(client, model_name, "In a hole in the ground", n=40, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    streamed = list(greedy(client, model_name, "In a hole in the ground", n=40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seeded_sampling_reproducible_and_n_choices(client, model_name) -> None:
    kw = dict(model=model_name, prompt="Hello", max_tokens=12, temperature=1.0, top_p=0.9, seed=11, extra_body=EXTRA)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=8, temperature=0, n=3,
                                  extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1 and r.usage.completion_tokens == 24


def test_concurrent_streams_are_batched_and_match_sequential(client, model_name, engine) -> None:
    prompts = [f"Story number {i} begins" for i in range(8)]
    sequential = [greedy(client, model_name, p, n=32).choices[0].text for p in prompts]
    steps_before = httpx.get(engine.url + "/health").json()["steps"]

    def stream(p: str) -> str:
        return "".join(c.choices[0].text for c in greedy(client, model_name, p, n=32, stream=True))
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(stream, prompts))
    assert concurrent == sequential
    steps = httpx.get(engine.url + "/health").json()["steps"] - steps_before
    assert steps < 8 * 32, f"{steps} steps for 8x32 tokens: requests were not batched"


def test_models_health_startup(engine, client, model_name) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name] and models[0].max_model_len == MAX_LEN
    health = httpx.get(engine.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    startup = httpx.get(engine.url + "/startup").json()
    assert list(startup["phases"]) == list(PHASES)
    assert startup["weights_source"] == "disk:off"
    assert startup["total_s"] == pytest.approx(sum(startup["phases"].values()), abs=1e-3)


def test_metrics_count_prefix_cache_tokens(engine, client, model_name) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(engine.url + "/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    before = scrape()
    prompt = "A shared system prompt that is long enough to fill several KV blocks of sixteen tokens. " * 3
    for question in ("One?", "Two?"):
        greedy(client, model_name, prompt + question, n=2)
    deadline = time.monotonic() + 5  # the front end's figures are the core's last heartbeat
    while (after := scrape())["understudy_prefix_cache_hit_tokens_total"] == before[
            "understudy_prefix_cache_hit_tokens_total"] and time.monotonic() < deadline:
        time.sleep(0.1)
    queried = after["understudy_prefix_cache_queried_tokens_total"] - before["understudy_prefix_cache_queried_tokens_total"]
    hit = after["understudy_prefix_cache_hit_tokens_total"] - before["understudy_prefix_cache_hit_tokens_total"]
    assert queried > 2 * 48 and hit >= 48  # the second request found the shared blocks
    assert after["understudy_engine_kv_blocks_total"] > 0 and after["understudy_engine_running_seqs"] == 0
    # where the time to first output went: 2 requests, each timed once, the parts inside the whole
    count = {part: after[f"understudy_engine_{part}_count"] - before[f"understudy_engine_{part}_count"]
             for part in ("ingress_seconds", "queue_seconds", "core_first_output_seconds", "first_output_seconds")}
    assert set(count.values()) == {2}, count
    total = {part: after[f"understudy_engine_{part}_sum"] - before[f"understudy_engine_{part}_sum"] for part in count}
    assert 0 <= total["queue_seconds"] <= total["core_first_output_seconds"] <= total["first_output_seconds"], total
    assert total["ingress_seconds"] > 0, total


BAD_REQUESTS = [
    ("completions", "{not json", 400, None, "not valid JSON"),
    ("completions", {"model": "no-such-model", "prompt": "x"}, 404, "model", "does not exist"),
    ("completions", {"prompt": "x"}, 400, "model", "Field required"),
    ("completions", {"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {"model": "M", "prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens", "exceeds the context"),
    ("completions", {"model": "M", "prompt": [5] * (MAX_LEN + 10)}, 400, "prompt", "leaving no room"),
    ("completions", {"model": "M", "prompt": [99999]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"model": "M", "prompt": "x", "n": 17}, 400, "n", "less than or equal to 16"),
    ("completions", {"model": "M", "prompt": "x", "best_of": 99}, 400, "best_of", "less than or equal to 16"),
    ("completions", {"model": "M", "prompt": "x", "n": 2, "best_of": 4}, 400, None, "best_of (4) must equal n"),
    ("completions", {"model": "M", "prompt": "x", "temperature": -0.5}, 400, "temperature", "greater than"),
    ("completions", {"model": "M", "prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("completions", {"model": "M", "prompt": "x", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("completions", {"model": "M", "prompt": "x", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("completions", {"model": "M", "prompt": "x", "top_k": -3}, 400, "top_k", "greater than or equal to -1"),
    ("completions", {"model": "M", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("completions", {"model": "M", "prompt": "x", "stop_token_ids": [70000]}, 400, "stop_token_ids", "outside"),
    ("completions", [1, 2, 3], 400, None, "valid dictionary"),
    ("chat/completions", {"model": "M", "messages": []}, 400, "messages", "at least 1 item"),
    ("chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages", "only text parts"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": MAX_LEN},
     400, "max_tokens", "exceeds the context"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_object"}}, 400, "response_format",
     "type 'json_object' is not supported (structured output)"),
    ("completions", b'{"model": "M", "prompt": "\xff\xfe"}', 400, None, "not UTF-8: byte 0xff at offset 26"),
    ("completions", {"model": "M", "prompt": "x", "seed": 10**23}, 400, "seed", "an integer past 64 bits"),
    # strict JSON types, as OpenAI (issue 23): no string for a number, no number for a boolean
    ("completions", {"model": "M", "prompt": "x", "max_tokens": "4"}, 400, "max_tokens", "valid integer (got '4')"),
    ("completions", {"model": "M", "prompt": "x", "max_tokens": 4.0}, 400, "max_tokens", "valid integer (got 4.0)"),
    ("completions", {"model": "M", "prompt": "x", "stream": "yes"}, 400, "stream", "valid boolean (got 'yes')"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "stream": 1}, 400, "stream",
     "valid boolean (got 1)"),
    ("completions", {"model": "M", "prompt": "x", "n": True}, 400, "n", "valid integer (got true)"),
    ("completions", {"model": "M", "prompt": "x", "seed": "7"}, 400, "seed", "valid integer"),
    ("completions", {"model": "M", "prompt": "x", "temperature": "0.5"}, 400, "temperature", "valid number"),
    ("completions", {"model": 7, "prompt": "x"}, 400, "model", "valid string (got 7)"),
    ("completions", {"model": "M", "prompt": "x", "stream_options": {"include_usage": "true"}}, 400, "stream_options",
     "stream_options.include_usage: Input should be a valid boolean"),
    ("completions", {"model": "M", "prompt": "x", "stop_token_ids": ["2"]}, 400, "stop_token_ids",
     "stop_token_ids.0: Input should be a valid integer"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": 5}]}, 400, "messages",
     "messages.0.content: Input should be a valid string or Input should be a valid list (got 5)"),
    # a union's error: the member that got furthest, without pydantic's member names
    ("completions", {"model": "M", "prompt": [1, "a"]}, 400, "prompt", "prompt.1: Input should be a valid integer"),
    ("completions", {"model": "M", "prompt": [[1], [2, "a"]]}, 400, "prompt",
     "prompt.1.1: Input should be a valid integer (got 'a')"),
]


@pytest.mark.parametrize("path,body,status,param,message", BAD_REQUESTS,
                         ids=[f"{i}-{b[0]}-{b[3]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_openai_error_and_engine_keeps_serving(engine, client, model_name, path, body, status, param,
                                                               message) -> None:
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": model_name}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = httpx.post(f"{engine.url}/v1/{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param and err["type"]
    assert greedy(client, model_name, "still there?", n=2).choices[0].finish_reason == "length"


def test_wrong_json_types_get_openai_code_invalid_type(engine, model_name) -> None:
    for body in ({"model": model_name, "prompt": "x", "max_tokens": "4"}, {"model": model_name, "prompt": [1, "a"]}):
        r = httpx.post(f"{engine.url}/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type", r.text


def test_openai_client_types_are_accepted(client, model_name) -> None:
    """Every field as the official client sends it (numbers given as ints included) still serves."""
    kw = dict(model=model_name, max_tokens=3, temperature=1, top_p=1, presence_penalty=0, frequency_penalty=0,
              seed=5, n=2, stop=["zzzz"], user="u-1", logit_bias={}, extra_body=EXTRA)
    r = client.completions.create(prompt=["Hello", "World"], best_of=2, **kw)
    assert len(r.choices) == 4 and r.usage.completion_tokens == 12
    r = client.completions.create(prompt=[[5, 6, 7]], **{**kw, "n": 1})
    assert r.choices[0].finish_reason == "length"
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": " hi"}]}]
    r = client.chat.completions.create(messages=msgs, max_completion_tokens=3, **{**kw, "max_tokens": None})
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    assert chunks[-1].usage.completion_tokens == 6


def test_client_disconnect_mid_stream_aborts_only_that_sequence(engine, client, model_name) -> None:
    before = httpx.get(engine.url + "/health").json()
    body = {"model": model_name, "prompt": "Go on forever", "max_tokens": MAX_LEN - 16, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 10
    while (h := httpx.get(engine.url + "/health").json())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h["running"] == 0 and h["waiting"] == 0
    assert h["served"] == before["served"], "the sequence ran to completion instead of being aborted"
    assert greedy(client, model_name, "next one", n=3).usage.completion_tokens == 3


def test_a_body_sent_in_pieces_is_read_whole(engine, model_name) -> None:
    body = json.dumps({"model": model_name, "prompt": "Once upon", "max_tokens": 3, "temperature": 0}).encode()
    pieces = (body[i:i + 7] for i in range(0, len(body), 7))  # chunked transfer coding, several reads
    r = httpx.post(engine.url + "/v1/completions", content=pieces, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_a_stream_whose_client_leaves_at_once_is_aborted(engine, model_name) -> None:
    """A stream's sequences start before its response does: a client gone before the first byte
    must still free them."""
    before = httpx.get(engine.url + "/health").json()
    body = json.dumps({"model": model_name, "prompt": "Go on forever", "max_tokens": MAX_LEN - 16,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    host, port = engine.url.removeprefix("http://").split(":")
    for _ in range(5):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 10
    while (h := httpx.get(engine.url + "/health").json())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h["running"] == 0 and h["waiting"] == 0
    assert h["served"] == before["served"], "a sequence ran to completion instead of being aborted"


def test_boot_errors_exit_3_naming_the_problem(tiny_model, tmp_path) -> None:
    shutil.copytree(tiny_model, tmp_path / "bad-config")  # a hostile config.json: a boot error, not a crash loop
    hf = json.loads((tmp_path / "bad-config" / "config.json").read_text())
    (tmp_path / "bad-config" / "config.json").write_text(json.dumps({**hf, "num_key_value_heads": 0}))
    cases = {
        "bad-config": ({"model_path": str(tmp_path / "bad-config")},
                       "bad-config/config.json: num_key_value_heads: expected an integer >= 1, got 0"),
        "no-model": ({"model_path": str(tmp_path / "missing")}, "missing: checkpoint folder does not exist"),
        "tiny-kv": ({"kv_cache_bytes": 1 << 16}, "kv_cache_bytes=65536 cannot hold one sequence"),
        # under TP a worker rank may hit it first: still exit 3, not a SIGKILL of the group
        "tp2-tiny-kv": ({"kv_cache_bytes": 1 << 16, "tp_size": 2}, "kv_cache_bytes=65536 cannot hold one sequence"),
        "bad-warm": ({}, "UNDERSTUDY_WARM_FIRST_USE: kernels not one of sampling, graphs"),
    }
    procs = {}
    for name, (override, _) in cases.items():
        fields = {"name": name, "model_path": str(tiny_model), "port": 0, "runtime_dir": str(tmp_path / "rt")}
        cfg = EngineConfig(**{**fields, **override})
        env = {"UNDERSTUDY_WARM_FIRST_USE": "sampling,kernels"} if name == "bad-warm" else None
        procs[name] = EngineProcess(cfg, tmp_path / f"{name}.log", env=env)
    for name, (_, message) in cases.items():
        assert procs[name].proc.wait(60) == 3
        log = (tmp_path / f"{name}.log").read_text()
        assert re.search(rf"engine {name}( rank \d+)?: failed to start:", log) and message in log, log


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/completions", b"\xff\xfe{", 400),  # not decodable: FastAPI's own 400 "error parsing the body"
    ("GET", "/v1/nowhere", None, 404),
    ("GET", "/v1/completions", None, 405),
])
def test_framework_errors_use_the_openai_error_shape(engine, client, model_name, method, path, body, status) -> None:
    r = httpx.request(method, engine.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and r.json()["error"]["message"] and r.json()["error"]["type"]
    assert greedy(client, model_name, "still there?", n=2).choices[0].finish_reason == "length"
