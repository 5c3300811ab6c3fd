"""Server-sent events as the engines and the router write them (OpenAI's streaming format); no
imports, so the supervisor can use it without loading the engine's web stack."""
from __future__ import annotations

HEADERS: list[tuple[bytes, bytes]] = [(b"content-type", b"text/event-stream; charset=utf-8"),
                                      (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"  # the last event of a stream that ended well
# A comment (clients skip it) in a stream that asked for token ids, once per sequence the core has
# begun to run: the router tells a request an engine really ran from one it only queued (quarantine,
# supervisor/router/migrating.py). A chunk with token ids implies it too.
SCHEDULED = b": scheduled\n\n"
