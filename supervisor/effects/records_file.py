"""``{runtime_dir}/children.json``: written once per pass that changed what it holds (atomic rename,
0600), read by the next supervisor to re-adopt the children (supervisor/core/records.py is the
format, supervisor/core/adoption.py the decisions)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil
from pydantic import ValidationError

from supervisor.core.model import Node
from supervisor.core.records import RECORDS_VERSION, ChildRecord, ChildRecords
from supervisor.core.states import State

log = logging.getLogger("understudy")

RECORDS_FILE = "children.json"


def create_time(pid: int) -> float | None:
    """The process's start time (psutil), or None if it is gone or a zombie."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except psutil.Error:
        return None


class Snapshots:
    """Every child with a pid as a record; start times are read once per pid."""

    def __init__(self) -> None:
        self.create_times: dict[int, float | None] = {}

    def records(self, node: Node) -> ChildRecords:
        children = []
        for c in node.children():
            if not c.pid:
                continue
            started = self.create_times.get(c.pid)
            if started is None:
                started = self.create_times[c.pid] = create_time(c.pid)
            if started is None:
                continue  # already gone: nothing to adopt
            extra: dict = {"state": c.state.value, "incarnation": c.incarnation}
            if c.kind == "spawn_server":
                extra = {"state": "READY" if c.state == State.READY else "STARTING"}
            elif c.kind == "engine":
                extra.update(role=c.role.value, port=c.port, url=c.url, spawned=c.spawned)
            children.append(ChildRecord(kind=c.kind, name=c.name, pid=c.pid, create_time=started,
                                        config_key=node.wanted.key(c.kind, c.name) or "", **extra))
        live = {c.pid for c in children}
        for pid in [p for p in self.create_times if p not in live]:
            del self.create_times[pid]
        return ChildRecords(supervisor_pid=os.getpid(), epoch=node.epoch, primary=node.primary,
                            drained=node.drained, stopped=node.finished, children=children)


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
