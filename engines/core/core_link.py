"""The link between an engine's HTTP front end (its own process) and its scheduler (the engine
core: the process that owns the GPU), over two zmq PUSH/PULL pairs on private ipc sockets.

The front end parses, tokenizes and streams; the core schedules, runs the model, samples and
detokenizes. Apart, neither one's Python work waits for the other's GIL: serving hundreds of
streams no longer slows the steps, and a huge request being tokenized never delays a heartbeat.

Messages are JSON (never pickle). Front end -> core: `add` (key, prompt ids, sampling params,
group, replayed), `abort` (key), `together` (adds and aborts taken between the same two steps: a
failover's batch of continuations), `ready` (port). A continuation's ids are not JSON: its `add`
says where they are (`raw`: offset, ids, keys) in the message's second frame, raw int64
little-endian ids followed by its prompt's 16-byte block keys. 256 continuations' ~280,000 ids as
JSON lists took the core's link thread 7 ms of parsing on the dev VM, each id a Python int; raw,
each prompt is one array. The link's thread only decodes a message and gives each add its
sequence id: the scheduler thread makes the Sequences while the device runs its step (engines/core/engine.py
`put_later`), never while it schedules, under the same GIL. Core -> front end: `out` (one step's outputs: key and the
Output fields; and the stats after the step), `stats` (every heartbeat), `serve` (start listening; the startup summary),
`drain` (refuse new requests), `stop` (finish and exit).

The two sockets are files `{runtime_dir}/eng-{pid}-in.sock` and `-out.sock` (pid: rank 0's), made
0600 as they are bound, and removed as soon as the front end is connected both ways (its `ready`):
no one else ever connects, and an established ipc connection needs no file. So a serving engine,
even one SIGKILLed, leaves nothing behind; one that stops before its front end is connected removes
them on its way out (main.py), except when killed (SIGKILL): then whoever reaps it removes them
(`remove_sockets`: the spawn server does for its children; the supervisor for the others).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
from array import array
from pathlib import Path
from typing import Callable

import orjson
import zmq

from daemon.runtime_dir import ensure_private_dir

from wire.link_sockets import socket_paths
from .sampling import SamplingParams
from .sequence import Output, new_seq_id

log = logging.getLogger("engines.core.core_link")


@contextlib.contextmanager
def _private_files():
    """umask 0177 around a bind: the socket file is created 0600. (The umask is the process's: a file
    another thread creates in that moment is made private too, never more open.)"""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def endpoints(runtime_dir: str) -> tuple[str, str]:
    """(front end -> core, core -> front end) ipc endpoints of this engine process, in the private
    runtime dir (short names: a socket path has ~100 bytes)."""
    to_core, to_frontend = socket_paths(ensure_private_dir(Path(runtime_dir)), os.getpid())
    return f"ipc://{to_core}", f"ipc://{to_frontend}"


def encode(msg: dict) -> bytes:
    """JSON; an int64 array (a continuation's ids) as a list, written in one pass by orjson."""
    return orjson.dumps(msg, option=orjson.OPT_SERIALIZE_NUMPY)


decode = orjson.loads


def raw_ids(frame: memoryview, where: object) -> tuple[array, bytes | None]:
    """A continuation's prompt ids and block keys from its message's second frame: `where` is its
    `add`'s `raw`, [offset, number of ids, number of keys] (ValueError if it does not fit the frame)."""
    if not (isinstance(where, list) and len(where) == 3 and all(type(x) is int and x >= 0 for x in where)):
        raise ValueError(f"an add's raw must be [offset, ids, keys], three non-negative integers, not {where!r}")
    offset, n_ids, n_keys = where
    keys_at, end = offset + 8 * n_ids, offset + 8 * n_ids + 16 * n_keys
    if end > len(frame):
        raise ValueError(f"an add's raw {where} reaches byte {end} of a {len(frame)}-byte frame")
    ids = array("q")
    ids.frombytes(frame[offset:keys_at])
    if sys.byteorder == "big":
        ids.byteswap()
    return ids, bytes(frame[keys_at:end]) if n_keys else None


@dataclasses.dataclass(frozen=True)
class Route:
    """The emit target of one front-end request: the core sends its outputs under `key`."""

    key: int

    def __call__(self, out: Output) -> None:  # the core never delivers one by one
        raise RuntimeError("routes are delivered in batches")


class CoreLink:
    """The core's side: a thread reads the front end's messages and queues them for the scheduler
    thread, which makes their Sequences (`_later`) and sends each step's outputs and its stats."""

    def __init__(self, engine, to_core: str, to_frontend: str):  # noqa: ANN001 (LLMEngine: no import cycle)
        self.engine = engine
        ctx = zmq.Context.instance()
        self._paths = [to_core.removeprefix("ipc://"), to_frontend.removeprefix("ipc://")]
        self._pull = ctx.socket(zmq.PULL)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never block the scheduler: queue in zmq's own thread
        self._push.setsockopt(zmq.LINGER, 2000)
        try:
            with _private_files():  # bind() makes each file in the caller's thread: 0600 from the start
                self._pull.bind(to_core)
                self._push.bind(to_frontend)
        except BaseException:
            self.close()
            raise
        self._push_lock = threading.Lock()  # the scheduler thread and the main thread both send
        self._keys: dict[int, int] = {}  # front-end key -> engine sequence id
        self.port: int | None = None
        self.frontend_ready = threading.Event()
        engine.deliver = self._deliver
        engine.on_stats = lambda stats: self.send({"op": "stats", "stats": stats})

    def start(self) -> None:
        threading.Thread(target=self._receive, name="core-link", daemon=True).start()

    def send(self, msg: dict) -> bool:
        """Send to the front end; False (dropped) while it is not connected: a PUSH with no peer
        would block, and a front end that died before connecting would hang the engine."""
        with self._push_lock:
            try:
                self._push.send(encode(msg), zmq.NOBLOCK)  # never blocks once connected (no HWM)
                return True
            except zmq.Again:
                return False

    def close(self) -> None:
        """Remove the socket files (idempotent; the connections already made live on)."""
        for path in self._paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    def _deliver(self, batch: list[tuple[Callable, Output]]) -> None:
        """One step's outputs, in one message (scheduler thread)."""
        outs = [[route.key, *out.to_row()] for route, out in batch]
        for route, out in batch:
            if out.finish_reason is not None:
                self._keys.pop(route.key, None)
        self.send({"op": "out", "outs": outs, "stats": self.engine.stats()})

    def _receive(self) -> None:
        while True:
            try:
                frames = self._pull.recv_multipart(copy=False)
                msg = decode(frames[0].buffer)
                raw = frames[1].buffer if len(frames) > 1 else memoryview(b"")
                op = msg["op"]
                if op in ("add", "together"):
                    self.engine.put_later(self._later([msg] if op == "add" else msg["msgs"], raw))
                elif op == "abort":
                    seq_id = self._keys.pop(msg["key"], None)
                    if seq_id is not None:
                        self.engine.abort(seq_id)
                elif op == "ready":  # the front end is connected both ways: the files are not needed
                    self.close()
                    self.port = int(msg["port"])
                    self.frontend_ready.set()
                else:
                    log.warning("unknown message from the front end: %r", op)
            except zmq.ContextTerminated:
                return
            except Exception:  # a bad message must not stop the link
                log.exception("bad message from the front end")

    def _later(self, msgs: list[dict], raw: memoryview) -> Callable[[], list[tuple[str, object]]]:
        """The inbox items of these adds and aborts (an `add`, or a `together`'s), built when the
        scheduler thread calls the result (LLMEngine.put_later): here, on this thread, each add only
        gets its sequence id, so that an abort arriving after it maps to it. A malformed one is
        logged and left out; the others go on."""
        plan: list[tuple[dict, int]] = []
        for msg in msgs:
            try:
                key = msg["key"]
                if msg["op"] == "add":
                    seq_id = self._keys[key] = new_seq_id()
                    plan.append((msg, seq_id))
                elif msg["op"] == "abort" and (seq_id := self._keys.pop(key, None)) is not None:
                    plan.append((msg, seq_id))
            except Exception:  # noqa: BLE001
                log.exception("bad message from the front end, in a group")
        return functools.partial(self._build, plan, raw)

    def _build(self, plan: list[tuple[dict, int]], raw: memoryview) -> list[tuple[str, object]]:
        """`_later`'s items (the scheduler thread): an add whose Sequence cannot be made is answered
        with an error output naming why, never left waiting."""
        items: list[tuple[str, object]] = []
        for msg, seq_id in plan:
            if msg["op"] == "abort":
                items.append(("abort", seq_id))
                continue
            try:
                items.append(("add", self.engine.sequence(*self._add_args(msg, raw), seq_id=seq_id)))
            except Exception as e:  # noqa: BLE001 (the others go on)
                log.exception("bad add from the front end (key %r)", msg["key"])
                self._deliver([(Route(msg["key"]),
                                Output(seq_id, "", "error", 0, 0, error=f"the engine could not take this request: {e}"))])
        return items

    @staticmethod
    def _add_args(msg: dict, raw: memoryview) -> tuple:
        """An `add`'s arguments for LLMEngine.submit (and .sequence); `raw`: its message's second frame."""
        if "raw" not in msg and "prompt" not in msg:
            raise ValueError("an add carries its prompt's ids: a `prompt`, or a `raw` in its second frame")
        prompt, keys = raw_ids(raw, msg["raw"]) if "raw" in msg else (msg["prompt"], None)
        return (prompt, SamplingParams(**msg["params"]), Route(msg["key"]), msg["group"],
                msg.get("replayed", 0), keys)
