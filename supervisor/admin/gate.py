"""The admin API's bearer token, checked on each request's head by the listener
(wire/guarded_http.py Gate) before any of its body is read: a request without the token gets
its 401 at once and its connection is closed (a 500 MB body is never read); a connection that sent
the token is never closed to make room for others. ``/ui`` (the static status page) is open.
The app checks the token again (supervisor/admin/api.py), with the same function."""
from __future__ import annotations

import hmac
import json

from wire.guarded_http import Gate

UNAUTHORIZED = "missing or wrong bearer token (see admin.token_file, or `understudy token`)"
OPEN_PATHS = frozenset({b"/ui"})  # GET /ui holds no data (supervisor/admin/status_page.py)


def bearer_ok(authorization: bytes, expected: bytes) -> bool:
    """An Authorization header value carries the token (the scheme is case-insensitive, RFC 9110;
    the token is not)."""
    scheme, _, credentials = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), expected)


def bearer_gate(token: str) -> Gate:
    """The admin listener's Gate for ``token``."""
    expected = token.encode()
    body = json.dumps({"error": UNAUTHORIZED}).encode()
    refusal = (b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\nwww-authenticate: Bearer\r\n"
               b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    def check(path: bytes, headers: list[tuple[bytes, bytes]]) -> bool | None:
        for name, value in headers:
            if name == b"authorization":
                if bearer_ok(value, expected):
                    return True
                break
        return None if path in OPEN_PATHS else False
    return Gate(check, refusal)
