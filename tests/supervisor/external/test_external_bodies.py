"""What the router sends an external engine (supervisor/router/continuation.py `Tracked.upstream_body`
with the engine's Abilities): the client's request as a stream under the engine's model id, then its
continuation by the path the engine takes; and why a request cannot be continued."""
from __future__ import annotations

import orjson

from supervisor.router.abilities import Abilities
from supervisor.router.continuation import Tracked

VLLM = Abilities(model_id="org/model", token_ids=True, chat_continue=True)
PLAIN = Abilities(model_id="/models/m")


def tracked(path: str, req: dict) -> Tracked:
    t = Tracked.parse(path, req, keep_text=True)
    assert t is not None
    return t


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)


def test_first_attempt_is_the_clients_request_under_the_engines_id():
    t = tracked("/v1/completions", {"model": "x", "prompt": "Hi", "max_tokens": 8})
    body = orjson.loads(t.upstream_body(PLAIN))
    assert body == {"model": "/models/m", "prompt": "Hi", "max_tokens": 8, "stream": True}  # (no seed of ours)
    assert orjson.loads(t.upstream_body(VLLM))["return_token_ids"] is True


def test_completions_continue_by_ids_or_by_text():
    t = tracked("/v1/completions", {"model": "x", "prompt": "Hi", "max_tokens": 8, "seed": 5})
    t.feed(sse({"id": "c1", "created": 1, "choices": [{"text": "a", "token_ids": [7], "prompt_token_ids": [1, 2]}]},
               {"id": "c1", "created": 1, "choices": [{"text": "b", "token_ids": [8]}]}))
    ids = orjson.loads(t.upstream_body(VLLM))
    assert ids["prompt"] == [1, 2, 7, 8] and ids["max_tokens"] == 6 and ids["seed"] == 5
    text = orjson.loads(t.upstream_body(PLAIN))
    assert text["prompt"] == "Hiab" and text["max_tokens"] == 6 and "return_token_ids" not in text


def test_a_chat_continues_the_assistants_partial_message():
    t = tracked("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "Hi"}],
                                         "max_completion_tokens": 10})
    t.feed(sse({"id": "c", "created": 1, "choices": [{"delta": {"role": "assistant"}}]},
               {"id": "c", "created": 2, "choices": [{"delta": {"content": "Hel"}}]},
               {"id": "c", "created": 2, "choices": [{"delta": {"content": "lo"}}]}))
    assert t.n_output == 2  # a chunk of text without ids counts as one token
    body = orjson.loads(t.upstream_body(VLLM))
    assert body["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_completion_tokens"] == 8 and "return_token_ids" not in body
    assert "continue_final_message" in t.not_continuable(PLAIN)
    assert t.not_continuable(VLLM) is None


def test_a_prompt_of_ids_needs_an_engine_that_takes_ids():
    t = tracked("/v1/completions", {"model": "x", "prompt": [5, 6, 7], "max_tokens": 4})
    t.feed(sse({"id": "c", "created": 1, "choices": [{"text": "z"}]}))
    assert "its prompt is token ids" in t.not_continuable(PLAIN)
    assert t.not_continuable(None) is None  # (our own engine: its own rules)
