"""Wire messages of the daemon socket (pydantic; sent as JSON frames by daemon/framing.py).

Requests carry `op`; replies carry `type` (`ok`, `mismatch`, `loading`, `error`).
An `attach` answered `ok` also passes two fds: the arena, and a sealed memfd holding the manifest
(a manifest of 100k tensors does not fit in one frame). A `kv_attach` answered `ok` passes the
shared KV pool and its block index (daemon/kv_pool.py).
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .fingerprint import CacheConfig
from .kv_layout import KVLayout

PROTOCOL_VERSION = 1


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hello(_Msg):
    op: Literal["hello"] = "hello"
    protocol: int = PROTOCOL_VERSION
    client: str = ""


class Attach(_Msg):
    op: Literal["attach"] = "attach"
    fingerprint: CacheConfig


class KVAttach(_Msg):
    """Ask for the rank's shared KV pool (answered `ok` + `kv_pool` + fds [pool, index])."""

    op: Literal["kv_attach"] = "kv_attach"
    fingerprint: CacheConfig


class Status(_Msg):
    op: Literal["status"] = "status"


class Ping(_Msg):
    op: Literal["ping"] = "ping"


Request = Annotated[Union[Hello, Attach, KVAttach, Status, Ping], Field(discriminator="op")]
REQUEST = TypeAdapter(Request)


class Progress(_Msg):
    """How far the arena has been filled."""

    bytes_done: int = 0
    bytes_total: int = 0
    elapsed_s: float = 0.0
    gbps: float = 0.0


class DaemonInfo(_Msg):
    """What `hello`, `status` and `ping` report about the daemon."""

    pid: int
    rank: int
    state: Literal["starting", "loading", "ready", "failed"]
    transport: Literal["cpu", "cuda"]
    protocol: int = PROTOCOL_VERSION
    fingerprint: CacheConfig | None = None
    resident_bytes: int = 0
    tensors: int = 0
    progress: Progress = Progress()
    load_seconds: float | None = None
    attaches: int = 0
    error: str | None = None
    weights_finite: bool | None = None  # every tensor was checked finite after loading (None: not yet)
    kv_pool: KVLayout | None = None  # the shared KV pool, once allocated (None: this daemon has none)
    kv_pool_id: str | None = None  # its identity, hex (KVPoolHandle.pool_id: what an engine that maps it reports)


class ArenaHandle(_Msg):
    """How to map the arena fd (fds[0]); fds[1] holds the manifest JSON."""

    transport: Literal["cpu", "cuda"]
    size: int
    manifest_bytes: int


class KVPoolHandle(_Msg):
    """How to map the KV pool fd (fds[0], `size` bytes) and its index memfd (fds[1], `index_bytes`)."""

    transport: Literal["cpu", "cuda"]
    size: int
    index_bytes: int
    layout: KVLayout
    pool_id: str  # hex: the pool's identity (a restarted daemon's pool is another pool)


class Ok(_Msg):
    type: Literal["ok"] = "ok"
    daemon: DaemonInfo
    arena: ArenaHandle | None = None
    kv_pool: KVPoolHandle | None = None


class Mismatch(_Msg):
    type: Literal["mismatch"] = "mismatch"
    fields: list[str]
    fingerprint: CacheConfig


class Loading(_Msg):
    type: Literal["loading"] = "loading"
    progress: Progress


class Error(_Msg):
    type: Literal["error"] = "error"
    message: str


Reply = Annotated[Union[Ok, Mismatch, Loading, Error], Field(discriminator="type")]
REPLY = TypeAdapter(Reply)
