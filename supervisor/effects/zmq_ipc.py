"""A zmq socket bound to a private ipc:// path (0600, created under umask 077)."""
from __future__ import annotations

import os

import zmq


def bind_private_ipc(ctx: zmq.Context, kind: int, path: str, **options: int) -> zmq.Socket:
    """A `kind` socket bound at ipc://`path` (a stale file there is replaced), LINGER 0 + `options`."""
    if os.path.exists(path):
        os.unlink(path)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    old = os.umask(0o077)
    try:
        sock.bind(f"ipc://{path}")
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return sock
