"""Client of the spawn server (engines/process/spawn_server.py): spawn, wait, ping over framed JSON."""
from __future__ import annotations

import socket

from daemon.framing import recv_frame, send_frame

from wire.engine_config import EngineConfig


class SpawnError(RuntimeError):
    """The spawn server answered `{"ok": false, "error": ...}`."""


class SpawnClient:
    """One connection to a spawn server; each call is one request frame and one reply frame."""

    def __init__(self, path: str, timeout: float = 30.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)

    def request(self, obj: dict) -> dict:
        send_frame(self.sock, obj)
        reply, _ = recv_frame(self.sock)
        if not reply.get("ok"):
            raise SpawnError(reply.get("error", f"spawn server refused {obj.get('op')!r}"))
        return reply

    def ping(self) -> None:
        self.request({"op": "ping"})

    def spawn(self, cfg: EngineConfig, log_path: str) -> int:
        """Fork an engine; returns its pid (the leader of its own session)."""
        return self.request({"op": "spawn", "config": cfg.model_dump(mode="json"), "log_path": log_path})["pid"]

    def wait(self, pid: int) -> int | None:
        """The engine's exit code (negative: killed by that signal), or None while it runs."""
        return self.request({"op": "wait", "pid": pid})["returncode"]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "SpawnClient":
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self.close()
