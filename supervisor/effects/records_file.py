"""``{runtime_dir}/children.json``: what a supervisor must know to re-adopt its children after it died.

One record per live child (daemon, spawn server, engine): pid plus its start time (so a reused pid
is never taken for ours), incarnation, role, URL and the key of the config it was started with.
Written by atomic rename, 0600, on every change (every state transition, promotion, spawn).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger("understudy")

RECORDS_FILE = "children.json"
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


def create_time(pid: int) -> float | None:
    """The process's start time (psutil), or None if it is gone or a zombie."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except psutil.Error:
        return None


def same_process(recorded: float, observed: float | None) -> bool:
    """Whether a pid's observed start time is the recorded one (else: gone, or the pid was reused)."""
    return observed is not None and abs(observed - recorded) <= CREATE_TIME_TOLERANCE_S


def write_records(rd: Path, records: ChildRecords) -> None:
    """Atomically replace ``children.json`` (0600); an error is logged, never raised."""
    tmp = rd / f".{RECORDS_FILE}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(records.model_dump_json(indent=1))
        os.replace(tmp, rd / RECORDS_FILE)
    except OSError as e:
        log.warning("cannot write %s: %s (a restarted supervisor could not re-adopt children)",
                    rd / RECORDS_FILE, e)


def read_records(rd: Path) -> ChildRecords | None:
    """The records a previous supervisor left, or None (missing, or unreadable: said in the log)."""
    path = rd / RECORDS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read %s: %s; no child is re-adopted", path, e)
        return None
    try:
        records = ChildRecords.model_validate_json(text)
    except ValidationError as e:
        log.warning("%s is not valid (%s); no child is re-adopted", path, str(e).splitlines()[0])
        return None
    if records.version != RECORDS_VERSION:
        log.warning("%s has version %s, expected %d; no child is re-adopted", path, records.version,
                    RECORDS_VERSION)
        return None
    return records
