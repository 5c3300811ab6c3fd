"""Engine side: fill a model on meta from the daemon's arena, or from disk (DESIGN.md §2 modes).

| mode     | does                               | on a miss                                        |
|----------|------------------------------------|--------------------------------------------------|
| `client` | attaches to a running daemon       | loads from disk, source `disk:<reason>`          |
| `daemon` | starts its own daemon, attaches    | raises WeightCacheError (a 2nd copy would OOM)   |
| `off`    | loads from disk                    | -                                                |

Miss reasons: no_daemon, refused, mismatch, loading_timeout, daemon_error,
protocol_error, attach_failed.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import nn

from .arena import ArenaError, Manifest, bind, build_views, check_materialised, layout
from .cli import daemon_argv
from .fingerprint import CacheConfig
from .framing import FrameError, close_fds, peer_uid, recv_frame, send_frame
from .protocol import PROTOCOL_VERSION, REPLY, ArenaHandle, Attach, Error, Hello, KVAttach, Loading, Mismatch, Ok
from .runtime_dir import daemon_socket_path

log = logging.getLogger("understudy.client")

CONNECT_TIMEOUT_S = 5.0
REPLY_TIMEOUT_S = 30.0
DEFAULT_WAIT_S = float(os.environ.get("UNDERSTUDY_ATTACH_WAIT_S", "120"))
DAEMON_START_TIMEOUT_S = 600.0


class WeightCacheError(Exception):
    """`daemon` mode could not attach; the message says why and what to do."""


class CacheMiss(Exception):
    """The arena cannot be used; `reason` is a short label, the message a one-line explanation."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class WeightsResult:
    """Where the weights came from (`cache_hit`, `disk:<reason>`, `disk:off`), timings, and what
    keeps the mapping alive (hold it as long as the model is used)."""

    source: str
    timings: dict[str, float] = field(default_factory=dict)
    keepalive: object = None
    detail: str = ""


@dataclass
class ArenaMapping:
    """A client's read-only mapping of a daemon arena."""

    transport: str
    size: int
    region: torch.Tensor
    mapping: object
    manifest: Manifest


def attach_or_load(model_on_meta: nn.Module, cache_config: CacheConfig, mode: str, runtime_dir: str | os.PathLike,
                   rank: int, device: str | torch.device, *, wait_s: float = DEFAULT_WAIT_S) -> WeightsResult:
    """Fill `model_on_meta` in place (on `device`) from the rank's daemon or from disk, per `mode`."""
    device = torch.device(device)
    if mode == "off":
        return _from_disk(model_on_meta, cache_config, device, "disk:off", "")
    if mode == "client":
        try:
            return attach(model_on_meta, cache_config, runtime_dir, rank, device, wait_s=wait_s)
        except CacheMiss as miss:
            log.warning("rank %d: weight cache miss (%s): %s; loading from disk", rank, miss.reason, miss)
            return _from_disk(model_on_meta, cache_config, device, f"disk:{miss.reason}", str(miss))
    if mode == "daemon":
        try:
            started = ensure_daemon(cache_config, runtime_dir, rank, device)
            try:
                return attach(model_on_meta, cache_config, runtime_dir, rank, device, wait_s=DAEMON_START_TIMEOUT_S)
            except CacheMiss as miss:
                if started is None or miss.reason not in ("no_daemon", "daemon_error", "protocol_error"):
                    raise
                raise _exit_reason(started, rank, runtime_dir, wait_s=5.0) or miss from None
        except CacheMiss as e:
            raise WeightCacheError(f"weight_cache_mode=daemon, rank {rank}: {e}") from None
    raise ValueError(f"weight_cache_mode {mode!r} is not one of client, daemon, off")


def attach(model_on_meta: nn.Module, cache_config: CacheConfig, runtime_dir: str | os.PathLike, rank: int,
           device: torch.device, *, wait_s: float = DEFAULT_WAIT_S) -> WeightsResult:
    """Map the daemon's arena into `model_on_meta`; raises CacheMiss on any kind of miss."""
    t0 = time.perf_counter()
    path = daemon_socket_path(runtime_dir, rank)
    timings: dict[str, float] = {}
    with open_session(path) as sock:
        timings["connect_s"] = time.perf_counter() - t0
        t_wait = time.perf_counter()
        reply, fds = when_ready(sock, Attach(fingerprint=cache_config), path, wait_s)
        handle = reply.arena
        timings["wait_s"] = time.perf_counter() - t_wait
    try:
        t1 = time.perf_counter()
        mapping = _map(handle, fds, device)
        timings["map_s"] = time.perf_counter() - t1
    except (OSError, RuntimeError, ValueError, ValidationError) as e:
        raise CacheMiss("attach_failed", f"cannot map the arena from {path}: {str(e).splitlines()[0]}") from None
    finally:
        close_fds(fds)
    try:
        t2 = time.perf_counter()
        expected = layout(model_on_meta)
        if expected.entries() != mapping.manifest.entries():
            raise ArenaError(f"arena manifest from {path} does not match this model: {_first_diff(expected, mapping.manifest)}")
        views = build_views(mapping.region, mapping.manifest)
        timings["views_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        bind(model_on_meta, views, mapping.manifest)
        timings["bind_s"] = time.perf_counter() - t3
        t4 = time.perf_counter()
        check_materialised(model_on_meta, expected.entries(), device)
        timings["check_s"] = time.perf_counter() - t4
    except ArenaError as e:
        raise CacheMiss("attach_failed", str(e)) from None
    timings["total_s"] = time.perf_counter() - t0
    return WeightsResult("cache_hit", timings, mapping, f"{len(mapping.manifest.names)} tensors, {mapping.size} bytes")


def open_session(path: Path) -> socket.socket:
    """A connection to the daemon at `path` that said hello in our protocol; CacheMiss otherwise."""
    sock = _connect(path)
    try:
        reply, fds = _request(sock, Hello(client=f"pid {os.getpid()}").model_dump(mode="json"), path)
        close_fds(fds)
        if isinstance(reply, Error):
            raise CacheMiss("refused", f"daemon at {path} refused us: {reply.message}")
        if not isinstance(reply, Ok):
            raise CacheMiss("protocol_error", f"daemon at {path} answered hello with {reply.type}")
        if reply.daemon.protocol != PROTOCOL_VERSION:
            raise CacheMiss("protocol_error", f"daemon at {path} speaks protocol {reply.daemon.protocol}, "
                                              f"we speak {PROTOCOL_VERSION}")
    except BaseException:
        sock.close()
        raise
    return sock


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as e:
        sock.close()
        raise CacheMiss("no_daemon", f"no daemon listens at {path} ({e.strerror})") from None
    except PermissionError as e:
        sock.close()
        raise CacheMiss("refused", f"not allowed to connect to {path} ({e.strerror})") from None
    except OSError as e:
        sock.close()
        raise CacheMiss("no_daemon", f"cannot connect to {path}: {e}") from None
    uid = peer_uid(sock)
    if uid != os.getuid():  # never map memory handed out by another user's process
        sock.close()
        raise CacheMiss("refused", f"{path} is served by uid {uid}, not by us (uid {os.getuid()})")
    sock.settimeout(REPLY_TIMEOUT_S)
    return sock


def _request(sock: socket.socket, request: dict, path: Path):
    try:
        send_frame(sock, request)
    except OSError:
        pass  # the daemon may have answered (e.g. refused our uid) and closed: read that answer
    try:
        obj, fds = recv_frame(sock)
    except (FrameError, OSError) as e:
        raise CacheMiss("protocol_error", f"daemon at {path}: {e}") from None
    try:
        return REPLY.validate_python(obj), fds
    except ValidationError as e:
        close_fds(fds)
        raise CacheMiss("protocol_error", f"daemon at {path} sent a malformed reply: {str(e).splitlines()[0]}") from None


def when_ready(sock: socket.socket, request: Attach | KVAttach, path: Path, wait_s: float) -> tuple[Ok, list[int]]:
    """Send `request` until the daemon answers it `ok` with two fds (it answers `loading` meanwhile)."""
    deadline = time.monotonic() + wait_s
    frame = request.model_dump(mode="json")
    delay = 0.02
    while True:
        reply, fds = _request(sock, frame, path)
        if isinstance(reply, Ok) and (reply.arena or reply.kv_pool) is not None and len(fds) == 2:
            return reply, fds
        close_fds(fds)
        if isinstance(reply, Mismatch):
            ours, theirs = request.fingerprint.model_dump(), reply.fingerprint.model_dump()
            detail = ", ".join(f"{f} (ours {ours[f]!r}, daemon {theirs[f]!r})" for f in reply.fields)
            raise CacheMiss("mismatch", f"daemon at {path} holds different weights: {detail}")
        if isinstance(reply, Error):
            raise CacheMiss("daemon_error", f"daemon at {path}: {reply.message}")
        if not isinstance(reply, Loading):
            raise CacheMiss("protocol_error", f"daemon at {path} answered {request.op} with {reply.type} and "
                                              f"{len(fds)} fds")
        if time.monotonic() >= deadline:
            p = reply.progress
            raise CacheMiss("loading_timeout", f"daemon at {path} still loading after {wait_s:.1f} s "
                                               f"({p.bytes_done / 1e6:.0f} of {p.bytes_total / 1e6:.0f} MB)")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _map(handle: ArenaHandle, fds: list[int], device: torch.device) -> ArenaMapping:
    from .transport_cpu import read_blob

    manifest = Manifest.model_validate_json(read_blob(fds[1]))
    if manifest.total_bytes > handle.size:
        raise ValueError(f"manifest needs {manifest.total_bytes} bytes, arena has {handle.size}")
    if handle.transport != device.type:
        raise ValueError(f"daemon arena is on {handle.transport}, this engine runs on {device.type}")
    if handle.transport == "cpu":
        from .transport_cpu import map_readonly

        region, mapping = map_readonly(fds[0], handle.size)
    else:
        from .transport_cuda import map_readonly as map_cuda

        region, mapping = map_cuda(fds[0], handle.size, device.index or 0)
    return ArenaMapping(handle.transport, handle.size, region, mapping, manifest)


def _first_diff(a: Manifest, b: Manifest) -> str:
    ea, eb = a.entries(), b.entries()
    for name in sorted(set(ea) | set(eb)):
        if ea.get(name) != eb.get(name):
            return f"tensor {name}: model {ea.get(name)}, arena {eb.get(name)}"
    return "no difference"


def load_from_disk(model_on_meta: nn.Module, model_dir: str | os.PathLike, device: torch.device,
                   threads: int | None = None) -> dict[str, float]:
    """Materialise `model_on_meta` on `device` (one region, ties kept) and load the checkpoint into it."""
    from .loader import load_checkpoint_into

    t0 = time.perf_counter()
    manifest = layout(model_on_meta)
    region = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
    bind(model_on_meta, build_views(region, manifest), manifest)
    t1 = time.perf_counter()
    stats = load_checkpoint_into(model_on_meta, model_dir, threads=threads)
    check_materialised(model_on_meta, manifest.entries(), device)
    return {"alloc_s": t1 - t0, "load_s": stats.seconds, "load_gbps": stats.gbps,
            "total_s": time.perf_counter() - t0}


def _from_disk(model: nn.Module, cache_config: CacheConfig, device: torch.device, source: str,
               detail: str) -> WeightsResult:
    return WeightsResult(source, load_from_disk(model, cache_config.model_path, device), None, detail)


def ensure_daemon(cache_config: CacheConfig, runtime_dir: str | os.PathLike, rank: int,
                  device: torch.device) -> subprocess.Popen | None:
    """Start this rank's daemon (detached, logging to the runtime dir) unless one already listens.

    Returns the started process (None if one was already listening) once it listens."""
    from .runtime_dir import ensure_private_dir

    path = daemon_socket_path(runtime_dir, rank)
    try:
        _connect(path).close()
        return None
    except CacheMiss as miss:
        if miss.reason != "no_daemon":
            raise
    ensure_private_dir(runtime_dir)
    cmd = daemon_argv(cache_config.model_path, rank, cache_config.tp_size, device.type, cache_config.dtype,
                      runtime_dir, device.index or 0)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    logfd = os.open(_log_path(runtime_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logfd, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    finally:
        os.close(logfd)
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            _connect(path).close()
            return proc
        except CacheMiss:
            pass
        exited = _exit_reason(proc, rank, runtime_dir, wait_s=0)
        if exited:
            raise exited
        time.sleep(0.05)
    raise CacheMiss("daemon_error", f"daemon for rank {rank} did not listen at {path} "
                                    f"within {DAEMON_START_TIMEOUT_S:.0f} s (log: {_log_path(runtime_dir, rank)})")


def _log_path(runtime_dir: str | os.PathLike, rank: int) -> Path:
    return Path(runtime_dir) / f"daemon-rank{rank}.log"


def _exit_reason(proc: subprocess.Popen, rank: int, runtime_dir: str | os.PathLike, wait_s: float) -> CacheMiss | None:
    """If `proc` exited (within `wait_s`), a CacheMiss quoting its error line from the log."""
    try:
        code = proc.wait(timeout=wait_s) if wait_s else proc.poll()
    except subprocess.TimeoutExpired:
        return None
    if code is None:
        return None
    log_path = _log_path(runtime_dir, rank)
    lines = log_path.read_text(errors="replace").strip().splitlines()
    errors = [ln for ln in lines if " ERROR " in ln or ln.startswith("understudy daemon:")]
    line = (errors or lines or ["(no output)"])[-1]
    return CacheMiss("daemon_error", f"daemon for rank {rank} exited with code {code}: {line} (log: {log_path})")
