"""Counts checked on the parsed JSON before validation (wire/limits.py `check_body`): prompts,
messages and the messages' characters, against a real engine with small limits (issue 23, item 4).
A body over a count is refused with the limit's 400 even when its items are invalid too: it was
never validated."""
from __future__ import annotations

import json

import httpx
import pytest

from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess
from wire.limits import LimitError, RequestLimits, check_body

LIMITS = RequestLimits(max_prompts=8, max_messages=50, max_message_chars=200)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-bounds")
    cfg = EngineConfig(name="bounds", model_path=str(tiny_model), port=0, runtime_dir=str(tmp / "rt"),
                       max_model_len=512, max_num_seqs=4, limits=LIMITS)
    proc = EngineProcess(cfg, tmp / "engine.log")
    proc.wait_ready(60)
    yield proc
    assert proc.stop() == 0


def post(engine, path: str, body) -> httpx.Response:
    return httpx.post(f"{engine.url}/v1/{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


def assert_limit(r: httpx.Response, key: str, param: str, said: str) -> None:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (key, param, "invalid_request_error"), err
    assert f"limits.{key}" in err["message"] and said in err["message"], err


def served(engine, model: str) -> None:
    r = post(engine, "chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_message_count_is_bounded_before_validation(engine, tiny_model) -> None:
    model = tiny_model.name
    msg = {"role": "user", "content": "hi"}
    assert post(engine, "chat/completions", {"model": model, "messages": [msg] * 50, "max_tokens": 1}).status_code == 200
    r = post(engine, "chat/completions", {"model": model, "messages": [msg] * 51})
    assert_limit(r, "max_messages", "messages", "the request has 51 messages; at most 50")
    # 200,000 messages no model accepts: refused for their count, not for a role (never validated)
    r = post(engine, "chat/completions", {"model": model, "messages": [{"role": "nobody", "content": 1}] * 200_000})
    assert_limit(r, "max_messages", "messages", "200000 messages")
    served(engine, model)


def test_message_characters_are_bounded_text_parts_included(engine, tiny_model) -> None:
    model = tiny_model.name
    text = "hello world " * 16 + "12345678"  # 200 characters
    r = post(engine, "chat/completions", {"model": model, "max_tokens": 1, "messages": [
        {"role": "system", "content": text[:120]},
        {"role": "user", "content": [{"type": "text", "text": text[120:150]}, {"type": "text", "text": text[150:]}]}]})
    assert r.status_code == 200, r.text
    r = post(engine, "chat/completions", {"model": model, "messages": [
        {"role": "system", "content": text[:120]},
        {"role": "user", "content": [{"type": "text", "text": text[120:]}, {"type": "text", "text": "!"}]}]})
    assert_limit(r, "max_message_chars", "messages", "the messages hold 201 characters; at most 200")
    served(engine, model)


def test_prompt_count_is_bounded_before_validation(engine, tiny_model) -> None:
    model = tiny_model.name
    r = post(engine, "completions", {"model": model, "prompt": ["hi"] * 8, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text
    for prompt in (["hi"] * 9, [[1, 2]] * 9, [{}] * 100_000):  # the last: not even prompts
        assert_limit(post(engine, "completions", {"model": model, "prompt": prompt}), "max_prompts", "prompt",
                     "at most 8 are allowed")
    served(engine, model)


def test_a_long_list_of_bad_items_is_one_error(engine, tiny_model) -> None:
    """Token ids then 500,000 strings: the first bad item ends validation (fail_fast)."""
    r = post(engine, "completions", {"model": tiny_model.name, "prompt": [1] + ["a"] * 500_000})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "invalid_type", err
    assert err["message"].startswith("prompt.1: Input should be a valid integer (got 'a')"), err
    served(engine, tiny_model.name)


@pytest.mark.parametrize("body,chat", [
    ([1, 2], True), ({"messages": "x"}, True), ({"messages": [None, 3, {"content": None}] * 10}, True),
    ({"messages": [{"content": [{"text": 5}, "x", {"type": "text"}] * 100}]}, True),
    ({"prompt": [1] * 10_000}, False), ({"prompt": "x" * 10_000}, False), ({"prompt": []}, False), ("x", False),
])
def test_shapes_it_does_not_count_are_left_to_validation(body, chat) -> None:
    check_body(LIMITS, body, chat)


def test_counts_at_the_limit_pass_and_over_it_fail() -> None:
    check_body(LIMITS, {"messages": [{"content": "x" * 4}] * 50}, True)
    with pytest.raises(LimitError) as e:
        check_body(LIMITS, {"messages": [{"content": "x" * 4}] * 51}, True)
    assert (e.value.status, e.value.key, e.value.param) == (400, "max_messages", "messages")
    with pytest.raises(LimitError) as e:
        check_body(LIMITS, {"messages": [{"content": [{"type": "text", "text": "x" * 201}]}]}, True)
    assert e.value.key == "max_message_chars"
    with pytest.raises(LimitError) as e:
        check_body(LIMITS, {"prompt": [[1]] * 9}, False)
    assert e.value.key == "max_prompts"
