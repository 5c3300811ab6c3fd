"""The node secret: an engine under a supervisor answers only requests that carry it, so no other
local user reaches an engine's port (the router's limits and the supervisor's fences are then the
only way in). One file per runtime dir, `node.secret` (0600 in the 0700 dir), made by the
supervisor on its first start, read by every engine it starts and by the supervisor's two HTTP
clients, which send it to loopback upstreams only (an external engine elsewhere never sees it)."""
from __future__ import annotations

import hmac
import json
from pathlib import Path

from .guarded_http import Gate
from .secret_file import ensure_token, read_token

HEADER = b"x-understudy-node"
FILE = "node.secret"
WHAT = "node secret"
REFUSED = "this engine serves its node only: requests must carry the node secret (x-understudy-node)"


def ensure(runtime_dir: str | Path) -> str:
    return ensure_token(Path(runtime_dir) / FILE, WHAT)


def read(path: str | Path) -> str:
    return read_token(Path(path), WHAT)


def headers(runtime_dir: str | Path) -> dict[str, str]:
    """The header a tool of the node's user sends to reach an engine directly (tests, benches)."""
    return {HEADER.decode(): read(Path(runtime_dir) / FILE)}


def gate(secret: str) -> Gate:
    """An engine listener's Gate: every request refused on its head (401) without the secret."""
    expected = secret.encode()
    body = json.dumps({"error": REFUSED}).encode()
    refusal = (b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\nconnection: close\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))

    def check(path: bytes, head: list[tuple[bytes, bytes]]) -> bool:
        return any(name == HEADER and hmac.compare_digest(value.strip(), expected) for name, value in head)
    return Gate(check, refusal)
