"""The events of a streaming answer, serialised without building pydantic models: a chunk per
stream per step is the front end's most frequent write, and `ChatCompletionChunk(...)
.model_dump_json(exclude=...)` cost more than the rest of a chunk's path. The bytes are exactly
what those models dump (wire/protocol.py stays the format's definition;
tests/engines/process/test_stream_chunks.py holds the two to each other): the request's fixed
fields are serialised once, each chunk adds its choice."""
from __future__ import annotations

import orjson


class ChunkWriter:
    """Server-sent events (`data: ...\\n\\n`) of one streaming request. `kind` is "completions" or
    "chat"; `usage`: the client asked for `stream_options.include_usage` (every chunk then carries
    `"usage": null`, the last one the counts); `ids`: it asked for `return_token_ids`."""

    def __init__(self, kind: str, rid: str, created: int, model: str, usage: bool, ids: bool) -> None:
        self.chat, self.ids = kind == "chat", ids
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self._head = b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model})[:-1] \
            + b',"choices":'
        self._usage = usage

    def choice(self, index: int, text: str | None, finish_reason: str | None, token_ids: list[int] | None = None,
               prompt_ids: list[int] | None = None, role: bool = False) -> bytes:
        """One choice's chunk: a completion's `text`, or a chat delta's `content` (None: no content;
        `role`: the assistant's opening delta). Ids are written only when the client asked for them."""
        if self.chat:
            c = {"index": index, "delta": {"role": "assistant" if role else None, "content": text},
                 "logprobs": None, "finish_reason": finish_reason}
            if self.ids:
                c["token_ids"] = token_ids
            return self._event([c], None, prompt_ids)
        c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.ids:
            c["prompt_token_ids"], c["token_ids"] = prompt_ids, token_ids
        return self._event([c], None, None)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last chunk of an `include_usage` stream: no choices, the request's counts."""
        return self._event([], {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens}, None)

    def _event(self, choices: list, usage: dict | None, prompt_ids: list[int] | None) -> bytes:
        rest: dict = {"usage": usage} if self._usage else {}
        if self.chat and self.ids:
            rest["prompt_token_ids"] = prompt_ids
        tail = orjson.dumps(rest)[1:] if rest else b"}"  # `"usage":...}` or the object's end
        return self._head + orjson.dumps(choices) + (b"," + tail if rest else tail) + b"\n\n"
