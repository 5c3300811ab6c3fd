"""The weight cache daemon of one rank: fills one arena, then hands its fd to every attaching engine.

One thread accepts connections (and wakes on SIGTERM through a self-pipe); one thread per client
answers its frames; one thread fills the arena. The arena fd is handed out only once the arena
is completely loaded, checked and (on cpu) sealed; until then `attach` is answered `loading`.
"""
from __future__ import annotations

import fcntl
import gc
import logging
import os
import selectors
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .arena import Manifest, bind, build_views, check_materialised, layout
from .fingerprint import CacheConfig, make_cache_config
from .framing import FrameError, PeerClosed, close_fds, peer_uid, recv_frame, send_frame
from .protocol import (REQUEST, ArenaHandle, Attach, DaemonInfo, Error, Hello, KVAttach, KVPoolHandle, Loading,
                       Mismatch, Ok, Ping, Progress, Status)
from .runtime_dir import daemon_socket_path, ensure_private_dir

log = logging.getLogger("understudy.daemon")

IDLE_TIMEOUT_S = 30.0
MAX_CLIENTS = 64


class DaemonConfig(BaseModel):
    """One rank's daemon: which checkpoint, how it is sharded, where it lives."""

    model_config = ConfigDict(extra="forbid")

    model_path: str
    rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    gpu_id: int | None = Field(default=None, ge=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    runtime_dir: str
    threads: int | None = Field(default=None, ge=1)
    max_load_mbps: float | None = Field(default=None, gt=0)
    kv_pool_bytes: int = Field(default=0, ge=0, description="the rank's shared KV pool (0: none)")
    kv_block_size: int = Field(default=16, ge=1, le=1024)
    kv_slots: int = Field(default=2, ge=1, le=64, description="engine slots: each gets a few scratch blocks")

    @property
    def torch_device(self) -> str:
        return "cpu" if self.device == "cpu" else f"cuda:{self.gpu_id if self.gpu_id is not None else self.rank}"


class DaemonAlreadyRunning(Exception):
    """Another live daemon holds this rank's lock and socket."""


class WeightDaemon:
    """Serve one rank's arena on `{runtime_dir}/daemon-rank{R}.sock` until SIGTERM."""

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.runtime_dir = ensure_private_dir(cfg.runtime_dir)
        self.socket_path = daemon_socket_path(self.runtime_dir, cfg.rank)
        self.state: Literal["starting", "loading", "ready", "failed"] = "starting"
        self.fingerprint: CacheConfig | None = None
        self.progress = Progress()
        self.error: str | None = None
        self.load_seconds: float | None = None
        self.weights_finite: bool | None = None  # every tensor checked finite once loaded
        self.attaches = 0
        self.arena = None
        self.manifest: Manifest | None = None
        self.manifest_fd = -1
        self.kv_pool = None  # daemon/kv_pool.py KVPool, once allocated
        self.clients = 0
        self.lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._exit_code: int | None = None
        self._last_log_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------
    def run(self) -> int:
        """Bind, load in the background, serve; returns the exit code (0 after SIGTERM)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._take_lock()
        listener = self._bind()
        threading.Thread(target=self._fill_arena, name="fill", daemon=True).start()
        log.info("rank %d: serving %s (pid %d)", self.cfg.rank, self.socket_path, os.getpid())
        try:
            self._serve(listener)
        finally:
            listener.close()
            self._unlink_socket_if_ours()
        log.info("rank %d: exiting with code %d", self.cfg.rank, self._exit_code)
        return self._exit_code or 0

    def _on_signal(self, signum: int, _frame) -> None:
        self.stop(0)

    def stop(self, code: int) -> None:
        """Ask the accept loop to exit with `code` (safe from signal handlers and threads)."""
        if self._exit_code is None:
            self._exit_code = code
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _take_lock(self) -> None:
        lock_path = self.runtime_dir / f"daemon-rank{self.cfg.rank}.lock"
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DaemonAlreadyRunning(
                f"a live daemon already serves rank {self.cfg.rank} at {self.socket_path} "
                f"(it holds {lock_path}); stop it first") from None

    def _bind(self) -> socket.socket:
        """Listen on a 0600 socket, atomically replacing a stale one left by a dead daemon."""
        if self.socket_path.exists() or self.socket_path.is_symlink():
            if _is_live(self.socket_path):
                raise DaemonAlreadyRunning(f"a live daemon answers at {self.socket_path}; stop it first")
            log.warning("rank %d: replacing stale socket %s (its daemon is gone)", self.cfg.rank, self.socket_path)
        tmp = self.socket_path.with_name(f".{self.socket_path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp))
        os.chmod(tmp, 0o600)
        sock.listen(128)
        os.replace(tmp, self.socket_path)
        self._socket_ino = os.stat(self.socket_path).st_ino
        return sock

    def _unlink_socket_if_ours(self) -> None:
        try:
            if os.stat(self.socket_path).st_ino == self._socket_ino:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass

    # ---- accept loop -----------------------------------------------------------------------
    def _serve(self, listener: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        while self._exit_code is None:
            for key, _ in sel.select():
                if key.data == "wake":
                    os.read(self._wake_r, 4096)
                else:
                    self._accept(listener)
        sel.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with self.lock:
            if self.clients >= MAX_CLIENTS:
                conn.close()
                log.warning("rank %d: refused a connection: %d clients already connected", self.cfg.rank, MAX_CLIENTS)
                return
            self.clients += 1
        threading.Thread(target=self._serve_client, args=(conn,), daemon=True).start()

    def _serve_client(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(IDLE_TIMEOUT_S)
                uid = peer_uid(conn)
                if uid != os.getuid():
                    log.warning("rank %d: refused a peer with uid %d", self.cfg.rank, uid)
                    _send_quietly(conn, Error(message=f"peer uid {uid} refused: this daemon serves uid {os.getuid()} only"))
                    _drain(conn)
                    return
                while self._exit_code is None and self._answer_one(conn):
                    pass
        except OSError:
            pass  # peer went away or timed out: nothing to answer
        finally:
            with self.lock:
                self.clients -= 1

    def _answer_one(self, conn: socket.socket) -> bool:
        """Read one frame and answer it; False ends the connection."""
        try:
            obj, fds = recv_frame(conn)
        except PeerClosed:
            return False
        except FrameError as e:
            log.warning("rank %d: bad frame from a client: %s", self.cfg.rank, e)
            _send_quietly(conn, Error(message=f"bad frame: {e}"))
            _drain(conn)
            return False
        close_fds(fds)  # clients have no business sending fds
        try:
            request = REQUEST.validate_python(obj)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "frame"
            send_frame(conn, Error(message=f"bad request: {where}: {first['msg']}").model_dump(mode="json"))
            return True
        try:
            reply, fds = self._reply(request)
        except Exception as e:  # a bug must not take the daemon down: answer it and go on
            log.exception("rank %d: internal error answering %s", self.cfg.rank, request.op)
            reply, fds = Error(message=f"internal error: {type(e).__name__}: {e}"), ()
        send_frame(conn, reply.model_dump(mode="json"), fds)
        return True

    def _reply(self, req) -> tuple[BaseModel, tuple[int, ...]]:
        if isinstance(req, (Hello, Status, Ping)):
            return Ok(daemon=self.info()), ()
        assert isinstance(req, (Attach, KVAttach))
        if self.state == "failed":
            return Error(message=f"daemon rank {self.cfg.rank} failed to load: {self.error}"), ()
        if self.fingerprint is not None:
            fields = self.fingerprint.differing_fields(req.fingerprint)
            if fields:
                return Mismatch(fields=fields, fingerprint=self.fingerprint), ()
        if self.state != "ready":
            return Loading(progress=self.progress), ()
        if isinstance(req, KVAttach):
            return self._kv_reply()
        with self.lock:
            self.attaches += 1
        handle = ArenaHandle(transport=self.cfg.device, size=self.arena.size,
                             manifest_bytes=os.fstat(self.manifest_fd).st_size)
        return Ok(daemon=self.info(), arena=handle), (self.arena.export_fd(), self.manifest_fd)

    def _kv_reply(self) -> tuple[BaseModel, tuple[int, ...]]:
        pool = self.kv_pool
        if pool is None:
            return Error(message=f"daemon rank {self.cfg.rank} holds no KV pool (started without --kv-pool-bytes)"), ()
        handle = KVPoolHandle(transport=self.cfg.device, size=pool.size, index_bytes=pool.index_bytes,
                              layout=pool.layout, pool_id=pool.pool_id.hex())
        return Ok(daemon=self.info(), kv_pool=handle), pool.fds()

    def info(self) -> DaemonInfo:
        """What this daemon is doing right now."""
        return DaemonInfo(pid=os.getpid(), rank=self.cfg.rank, state=self.state, transport=self.cfg.device,
                          fingerprint=self.fingerprint, resident_bytes=self.arena.size if self.state == "ready" else 0,
                          tensors=len(self.manifest.names) if self.manifest else 0, progress=self.progress,
                          load_seconds=self.load_seconds, attaches=self.attaches, error=self.error,
                          weights_finite=self.weights_finite, kv_pool=self.kv_pool.layout if self.kv_pool else None,
                          kv_pool_id=self.kv_pool.pool_id.hex() if self.kv_pool else None)

    # ---- filling the arena -----------------------------------------------------------------
    def _fill_arena(self) -> None:
        try:
            self._load()
        except Exception as e:  # any failure: say it in one line and stop
            self.error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            self.state = "failed"
            log.error("rank %d: load failed: %s", self.cfg.rank, self.error)
            self.stop(1)

    def _load(self) -> None:
        from models import build_model, read_model_args, torch_dtype  # daemon → engines, meta only

        cfg = self.cfg
        device = torch.device(cfg.torch_device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.fingerprint = make_cache_config(cfg.model_path, tp_rank=cfg.rank, tp_size=cfg.tp_size,
                                             dtype=cfg.dtype, device=str(device))
        self.state = "loading"
        t0 = time.perf_counter()
        model = build_model(read_model_args(cfg.model_path), tp_rank=cfg.rank, tp_size=cfg.tp_size,
                            dtype=torch_dtype(cfg.dtype), device="meta")
        manifest = layout(model)
        arena = _allocate(manifest.total_bytes, device, cfg.rank)
        bind(model, build_views(arena.region, manifest), manifest)
        from .loader import load_checkpoint_into

        stats = load_checkpoint_into(model, cfg.model_path, progress=self._on_progress,
                                     threads=cfg.threads, max_mbps=cfg.max_load_mbps)
        check_materialised(model, manifest.entries(), device)
        from .finite import check_finite

        check_finite(model, cfg.model_path)  # weights that cannot serve are never handed out
        self.weights_finite = True
        if cfg.kv_pool_bytes:
            self.kv_pool = self._allocate_kv_pool(model, device)
        del model
        gc.collect()
        arena.finish()  # seals the memfd on cpu; synchronizes on cuda
        from .transport_cpu import sealed_blob

        self.manifest_fd = sealed_blob(manifest.model_dump_json().encode())
        self.arena, self.manifest = arena, manifest
        self.load_seconds = time.perf_counter() - t0
        self.state = "ready"
        log.info("rank %d: ready: %d tensors, %.1f MB in %.2f s (read %.2f GB/s)", cfg.rank, len(manifest.names),
                 arena.size / 1e6, self.load_seconds, stats.gbps)

    def _allocate_kv_pool(self, model, device: torch.device):  # noqa: ANN001, ANN202 (CausalLM, KVPool)
        from .kv_pool import KVPool, fingerprint_digest, layout_for

        cfg = self.cfg
        layout = layout_for(model, cfg.kv_pool_bytes, cfg.kv_block_size, cfg.dtype, cfg.kv_slots)
        pool = KVPool(layout, fingerprint_digest(self.fingerprint), device, cfg.rank)
        log.info("rank %d: KV pool: %d blocks of %d tokens (%.1f MB, %d scratch blocks for each of %d slots)",
                 cfg.rank, layout.num_blocks, layout.block_size, pool.size / 1e6, layout.scratch_blocks,
                 layout.scratch_slots)
        return pool

    def _on_progress(self, p: Progress) -> None:
        if p.elapsed_s - self._last_log_s >= 2.0:
            self._last_log_s = p.elapsed_s
            log.info("rank %d: loading %.0f / %.0f MB (%.2f GB/s)", self.cfg.rank, p.bytes_done / 1e6,
                     p.bytes_total / 1e6, p.gbps)
        self.progress = p


def _allocate(size: int, device: torch.device, rank: int):
    if device.type == "cpu":
        from .transport_cpu import CpuArena

        return CpuArena(size, name=f"understudy-arena-rank{rank}")
    from .transport_cuda import CudaArena

    return CudaArena(size, device.index or 0)


def _is_live(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _drain(conn: socket.socket, timeout_s: float = 1.0) -> None:
    """Half-close and read what the peer still sends, so closing does not reset its connection."""
    try:
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        while conn.recv(65536) and time.monotonic() < deadline:
            pass
    except OSError:
        pass


def _send_quietly(conn: socket.socket, msg: BaseModel) -> None:
    try:
        send_frame(conn, msg.model_dump(mode="json"))
    except (OSError, FrameError):
        pass
