"""Spawn server: a warm parent (torch, tokenizers, engine code imported; CUDA untouched) that forks engines.

`python -m engines.process.spawn_server --socket PATH`. Frames as daemon/framing.py, one JSON request per
frame, one reply each (docs/CONTRACTS.md):
  {"op": "spawn", "config": EngineConfig, "log_path": str} -> {"ok": true, "pid": int}
  {"op": "wait", "pid": int}  -> {"ok": true, "pid": int, "returncode": int | null}   (never blocks)
  {"op": "ping"}              -> {"ok": true}
Errors: {"ok": false, "error": str}. The server is single-threaded (fork is only safe so), owns
no CUDA context, and reaps its children between requests.
"""
from __future__ import annotations

import argparse
import logging
import os
import selectors
import signal
import socket
import sys

import tokenizers  # noqa: F401  (imported for the children)
import torch  # noqa: F401
from pydantic import ValidationError

from daemon.framing import FrameError, PeerClosed, peer_uid, recv_frame, send_frame

from wire import gc_pauses
from engines.core import tokenizer
from . import main as _engine_main  # noqa: F401  (the whole engine stack, imported once
from .entry import run as run_engine
from wire.engine_config import EngineConfig
from wire.link_sockets import remove_sockets
from .forked import fork_into

log = logging.getLogger("engines.process.spawn_server")


class SpawnServer:
    """Accepts connections on an AF_UNIX socket and answers spawn/wait/ping requests."""

    def __init__(self, path: str):
        self.path = path
        if os.path.exists(path):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)  # created 0600
        finally:
            os.umask(old)
        self.listener.listen(16)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.children: dict[int, int | None] = {}  # pid -> returncode (None while running)
        self.runtime_dirs: dict[int, str] = {}  # pid -> its runtime dir, until reaped
        self.stopping = False

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        print(f"SPAWN_SERVER_READY {self.path} pid={os.getpid()}", flush=True)
        while not self.stopping:
            for key, _ in self.sel.select(timeout=0.5):
                if key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    self._check_peer(conn)
                else:
                    self._handle(key.fileobj)  # type: ignore[arg-type]
            self._reap()
        self.close()

    def _check_peer(self, conn: socket.socket) -> None:
        uid = peer_uid(conn)
        if uid != os.getuid():
            log.warning("refused a connection from uid %d", uid)
            conn.close()
            return
        self.sel.register(conn, selectors.EVENT_READ)

    def _handle(self, conn: socket.socket) -> None:
        try:
            req, fds = recv_frame(conn)
            for fd in fds:
                os.close(fd)
            reply = self._dispatch(req)
        except PeerClosed:
            self._drop(conn)
            return
        except (FrameError, OSError) as e:
            reply = {"ok": False, "error": f"bad frame: {e}"}
            self._send(conn, reply)
            self._drop(conn)
            return
        self._send(conn, reply)

    def _send(self, conn: socket.socket, reply: dict) -> None:
        try:
            send_frame(conn, reply)
        except (OSError, FrameError):
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _dispatch(self, req: dict) -> dict:
        op = req.get("op")
        if op == "ping":
            return {"ok": True}
        if op == "wait":
            pid = req.get("pid")
            if not isinstance(pid, int) or pid not in self.children:
                return {"ok": False, "error": f"wait: pid {pid!r} was not spawned by this server"}
            self._reap()
            return {"ok": True, "pid": pid, "returncode": self.children[pid]}
        if op == "spawn":
            try:
                cfg = EngineConfig.model_validate(req.get("config"))
            except ValidationError as e:
                err = e.errors()[0]
                return {"ok": False, "error": f"spawn: config.{'.'.join(map(str, err['loc']))}: {err['msg']}"}
            log_path = req.get("log_path")
            if not isinstance(log_path, str) or not log_path:
                return {"ok": False, "error": "spawn: log_path must be a non-empty string"}
            try:
                log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            except OSError as e:
                return {"ok": False, "error": f"spawn: cannot open log_path {log_path}: {e.strerror}"}
            try:
                pid = self._fork(cfg, log_fd)
            except OSError as e:  # EAGAIN/ENOMEM: refuse this spawn, keep serving
                return {"ok": False, "error": f"spawn: fork failed: {e.strerror}"}
            finally:
                os.close(log_fd)
            self.children[pid] = None
            self.runtime_dirs[pid] = cfg.runtime_dir
            return {"ok": True, "pid": pid}
        return {"ok": False, "error": f"unknown op {op!r}; expected spawn, wait or ping"}

    def _fork(self, cfg: EngineConfig, log_fd: int) -> int:
        def child() -> int:  # a new session, our sockets closed, output to the log
            os.setsid()
            for key in list(self.sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(null)
            os.close(log_fd)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            return run_engine(cfg)
        return fork_into(child)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.children:
                self.children[pid] = os.waitstatus_to_exitcode(status)
            if pid in self.runtime_dirs:  # a killed engine cannot remove its link sockets: we do
                for path in remove_sockets(self.runtime_dirs.pop(pid), pid):
                    log.info("removed %s, left by engine pid %d", path, pid)

    def close(self) -> None:
        self.sel.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.process.spawn_server", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="AF_UNIX socket path to listen on (made 0600)")
    parser.add_argument("--tokenizer", help="a checkpoint folder whose tokenizer engines inherit, read once here")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s spawn-server %(levelname)s %(message)s")
    try:
        import daemon.client  # noqa: F401  (client-mode attach, imported once for every child)
    except ImportError:
        pass
    try:  # the decode kernels, and Triton's per-process hashing: none of it touches CUDA
        from models.kernels import preload
        preload()
    except ImportError:  # no triton: engines decode through torch
        pass
    except Exception as e:  # noqa: BLE001 (an optimisation: children do it themselves if need be)
        logging.warning("decode kernels not preloaded: %s", e)
    if ns.tokenizer:
        try:
            tokenizer.preload(ns.tokenizer)
        except Exception as e:  # noqa: BLE001 (an optimisation: each engine reads it, and names what is wrong)
            logging.warning("tokenizer of %s not preloaded: %s", ns.tokenizer, e)
    gc_pauses.freeze_startup()  # what every engine inherits (torch, ...): none of their collections walks it
    SpawnServer(ns.socket).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
