"""What the load sends: one POST of a JSON body to an OpenAI path."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Request:
    """A request ready to go: its path, its JSON body, and whether it asks for a stream (its answer
    is then read as server-sent events)."""

    path: str
    body: bytes
    stream: bool

    @classmethod
    def of(cls, body: dict[str, Any], path: str = COMPLETIONS) -> "Request":
        return cls(path, orjson.dumps(body), bool(body.get("stream")))
