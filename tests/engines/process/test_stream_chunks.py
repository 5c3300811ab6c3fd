"""The streaming events the front end writes (engines/frontend/stream_chunks.py) are byte for byte
what the protocol's pydantic models dump, for every combination of the client's options."""
from __future__ import annotations

import itertools

import pytest

from wire.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, Delta,
                              Usage)
from engines.frontend.stream_chunks import ChunkWriter

TEXTS = ["", " plain", 'quote " back \\ slash', "tab\tnl\ncr\r ctrl\x01\x1f del\x7f", "héllo wörld ✓ 😀 \u2028",
         None]
RID, CREATED, MODEL = "cmpl-0123abc", 1_765_000_000, "m/odel \"1b\""


def sse(model) -> bytes:  # noqa: ANN001
    return b"data: " + model + b"\n\n"


@pytest.mark.parametrize("usage,ids", list(itertools.product([False, True], repeat=2)))
def test_completion_chunks_match_the_models(usage: bool, ids: bool) -> None:
    writer = ChunkWriter("completions", RID, CREATED, MODEL, usage, ids)
    exclude: dict = {} if usage else {"usage": True}
    if not ids:
        exclude["choices"] = {"__all__": {"prompt_token_ids": True, "token_ids": True}}
    for text, reason, prompt in itertools.product([t for t in TEXTS if t is not None], [None, "stop", "length"],
                                                  [None, [1, 2, 3]]):
        want = CompletionResponse(id=RID, created=CREATED, model=MODEL, choices=[CompletionChoice(
            index=2, text=text, finish_reason=reason, prompt_token_ids=prompt if ids else None,
            token_ids=[7, 8] if ids else None)]).model_dump_json(exclude=exclude or None)
        assert writer.choice(2, text, reason, [7, 8], prompt) == sse(want.encode())
    if usage:
        want = CompletionResponse(id=RID, created=CREATED, model=MODEL, choices=[],
                                  usage=Usage(prompt_tokens=5, completion_tokens=9, total_tokens=14)).model_dump_json()
        assert writer.usage(5, 9) == sse(want.encode())


@pytest.mark.parametrize("usage,ids", list(itertools.product([False, True], repeat=2)))
def test_chat_chunks_match_the_models(usage: bool, ids: bool) -> None:
    writer = ChunkWriter("chat", RID, CREATED, MODEL, usage, ids)
    exclude: dict = {} if usage else {"usage": True}
    if not ids:
        exclude.update({"prompt_token_ids": True, "choices": {"__all__": {"token_ids": True}}})

    def model(choices, usage_=None, prompt=None) -> bytes:  # noqa: ANN001
        return sse(ChatCompletionChunk(id=RID, created=CREATED, model=MODEL, choices=choices, usage=usage_,
                                       prompt_token_ids=prompt).model_dump_json(exclude=exclude or None).encode())
    opening = ChatChunkChoice(index=0, delta=Delta(role="assistant", content=""), token_ids=[] if ids else None)
    assert writer.choice(0, "", None, [], [4, 5], role=True) == model([opening], prompt=[4, 5] if ids else None)
    for text, reason in itertools.product(TEXTS, [None, "stop"]):
        choice = ChatChunkChoice(index=1, delta=Delta(content=text), finish_reason=reason,
                                 token_ids=[9] if ids else None)
        assert writer.choice(1, text, reason, [9]) == model([choice])
    if usage:
        assert writer.usage(3, 4) == model([], Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7))
