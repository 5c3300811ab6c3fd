"""The front end's view of the engine core (engines/core/core_link.py): `submit`, `abort`, `stats` and
`alive` as LLMEngine has them, over the link; outputs come back a step at a time and are handed
to each request on the event loop.

The core's messages are read by a reader callback on the zmq socket's file descriptor, not by a
task awaiting `recv`: a step's outputs reach the requests in the loop round that sees them, one
round sooner than through a task's wake-up, and with no future per message."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Callable, Iterator

import numpy as np
import zmq

from wire.block_keys import checked_prompt_keys
from engines.core.core_link import decode, encode
from engines.core.sampling import SamplingParams
from engines.core.sequence import Output

log = logging.getLogger("engines.frontend.engine_client")
RECONNECT_MS = 5  # zmq's default, 100 ms, was up to 100 ms of a restart (~50 on average)


class EngineClient:
    """Lives on the front end's event loop; `run()` reads the core's messages until `stop`."""

    def __init__(self, to_core: str, to_frontend: str, key_chain: tuple[bytes, int] | None = None):
        """``key_chain``: the core's block keys' (root, block size): a continuation's prompt keys
        are hashed here, beside the core (block_manager.prompt_keys)."""
        self.key_chain = key_chain
        ctx = zmq.Context()
        self._push = ctx.socket(zmq.PUSH)
        self._pull = ctx.socket(zmq.PULL)
        for sock in (self._push, self._pull):  # the core binds only once its graphs are captured:
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)  # connect soon after, not up to 100 ms later
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)  # queue in zmq's thread: a send never blocks the loop
        self._push.connect(to_core)
        self._pull.connect(to_frontend)
        self._keys = itertools.count()
        self._emits: dict[int, Callable[[Output], None]] = {}
        self._stats: dict = {}
        self._stats_at = time.monotonic()
        self._held: list[dict] | None = None  # adds and aborts of a `together` block, in order
        self._held_raw = bytearray()  # their continuations' raw ids (the `raw` frame), in order
        self.on_serve: Callable[[dict], None] | None = None
        self.on_drain: Callable[[], None] | None = None
        self.on_stop: Callable[[], None] | None = None

    # ---- the LLMEngine surface the HTTP server uses -----------------------------------------
    def submit(self, prompt_ids: list[int] | np.ndarray, params: SamplingParams, emit: Callable[[Output], None],
               group: int | None = None, replayed: int = 0, router_keys: bytes | None = None) -> int:
        """Queue a sequence in the core; `emit` runs on this loop with each Output. Returns its key.
        (`prompt_ids` as an int64 array: a continuation's, engines/frontend/server.py; its ids go raw, with
        its prompt's block keys: the router's when they check out, else hashed here.)"""
        key = next(self._keys)
        self._emits[key] = emit
        msg = {"op": "add", "key": key, "params": params.wire(), "group": group, "replayed": replayed}
        if not replayed:
            msg["prompt"] = prompt_ids
            self._request(msg)
            return key
        ids = np.asarray(prompt_ids, dtype="<i8")  # (a continuation's ids go raw: engines/core/core_link.py)
        keys = checked_prompt_keys(router_keys, ids, *self.key_chain) if self.key_chain is not None else b""
        msg["raw"] = [0, len(ids), len(keys) // 16]
        self._request(msg, ids.tobytes() + keys)
        return key

    def abort(self, key: int) -> None:
        if self._emits.pop(key, None) is not None:
            self._request({"op": "abort", "key": key})

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """The submits and aborts made inside (by any request, while the block runs) reach the core
        in one message, taken between the same two steps: a failover's batch of continuations
        starts in one step, not one step per continuation as each came (engines/frontend/continuation_batch.py)."""
        if self._held is not None:  # (nested: the outer block sends)
            yield
            return
        self._held, self._held_raw = [], bytearray()
        try:
            yield
        finally:
            held, raw, self._held, self._held_raw = self._held, self._held_raw, None, bytearray()
            if held:
                self._send({"op": "together", "msgs": held}, raw)

    def stats(self) -> dict:
        return dict(self._stats)

    def alive(self, stale_after_s: float = 30.0) -> bool:
        """The core's scheduler loop reported within `stale_after_s`."""
        return time.monotonic() - self._stats_at < stale_after_s

    def ready(self, port: int) -> None:
        self._send({"op": "ready", "port": port})

    # ---- the core's messages ---------------------------------------------------------------
    async def run(self) -> None:
        """Read the core's messages until it says `stop`."""
        loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        fd = self._pull.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain)
        try:
            self._drain()  # messages queued before the reader was added raise no edge of their own
            await self._stopped
        finally:
            loop.remove_reader(fd)

    def _drain(self) -> None:
        """Handle every message queued (zmq's descriptor signals an edge: read until none is left)."""
        while not self._stopped.done():
            try:
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(decode(raw))
            except Exception:  # a malformed message must not stop the reader
                log.exception("bad message from the core")

    def _handle(self, msg: dict) -> None:
        op = msg["op"]
        if "stats" in msg:
            self._stats, self._stats_at = msg["stats"], time.monotonic()
        if op == "out":
            outs = [(key, Output(*fields)) for key, *fields in msg["outs"]]
            outs.sort(key=_not_first)  # first outputs first: see _not_first
            for key, out in outs:
                emit = self._emits.get(key)
                if out.finish_reason is not None:
                    self._emits.pop(key, None)
                if emit is not None:
                    try:
                        emit(out)
                    except Exception:  # one request's failure is not the others'
                        log.exception("delivering an output of request %d", key)
        elif op == "serve" and self.on_serve:
            self.on_serve(msg)
        elif op == "drain" and self.on_drain:
            self.on_drain()
        elif op == "stop":
            if self.on_stop:
                self.on_stop()
            self._stopped.set_result(None)

    def _request(self, msg: dict, raw: bytes = b"") -> None:
        """Send `msg` (with `raw`, what its `raw` field places at offset 0), or hold it for `together`."""
        if self._held is None:
            self._send(msg, raw)
            return
        if raw:
            msg["raw"][0] = len(self._held_raw)
            self._held_raw += raw
        self._held.append(msg)

    def _send(self, msg: dict, raw: bytes | bytearray = b"") -> None:
        frames = [encode(msg), raw] if raw else [encode(msg)]
        self._push.send_multipart(frames, zmq.NOBLOCK)  # no high-water mark: zmq queues it


def _not_first(item: tuple[int, Output]) -> bool:
    """Sort key: a request's first output before the rest of a step's. Each emit wakes its stream's
    task, and the tasks run in that order, each building and writing its chunk: under load (a chunk
    per running stream per step) a new request's first token would otherwise wait behind them."""
    return item[1].timing is None
