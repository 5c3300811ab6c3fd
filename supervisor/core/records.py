"""``{runtime_dir}/children.json`` as data: what a supervisor must know to re-adopt its children after
it died. One record per live child (daemon, spawn server, engine): pid plus its start time (so a
reused pid is never taken for ours), incarnation, role, URL and the key of the config it was started
with. Read and written by supervisor/effects/records_file.py."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

RECORDS_VERSION = 1
CREATE_TIME_TOLERANCE_S = 0.05  # psutil reports boot time + jiffies: two reads of one process agree


class ChildRecord(BaseModel):
    """One child as its supervisor last saw it."""

    model_config = ConfigDict(extra="ignore")
    kind: Literal["daemon", "spawn_server", "engine"]
    name: str
    pid: int
    create_time: float
    config_key: str
    state: str = ""
    incarnation: int = 0
    role: str | None = None
    port: int = 0
    url: str = ""
    spawned: bool = False  # forked by the spawn server (it knows the exit status), not our own child


class ChildRecords(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="ignore")
    version: int = RECORDS_VERSION
    supervisor_pid: int
    epoch: int = 0
    primary: str | None = None
    drained: bool = False   # an operator's node drain outlives a supervisor crash (not a clean stop)
    stopped: bool = False   # written by a supervisor that stopped cleanly
    children: list[ChildRecord] = []


def config_key(**fields: Any) -> str:
    """A short stable hash of what a child was started with (a different key is never adopted)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


def same_process(recorded: float, observed: float | None) -> bool:
    """Whether a pid's observed start time is the recorded one (else: gone, or the pid was reused)."""
    return observed is not None and abs(observed - recorded) <= CREATE_TIME_TOLERANCE_S
