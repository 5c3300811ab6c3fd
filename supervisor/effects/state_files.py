"""The node on disk, once per pass that changed it: ``state.json`` (the ``GET /status`` body, 0600,
atomic rename) and, once re-adoption has used the previous one, ``children.json``."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.core.model import Node
from supervisor.effects.records_file import Snapshots, write_records

log = logging.getLogger("understudy")


class StateFiles:
    def __init__(self, rd: Path, status: Callable[[], dict[str, Any]]) -> None:
        self.rd, self.status = rd, status
        self.snapshots = Snapshots()

    def write(self, node: Node) -> None:
        try:
            data = json.dumps(self.status(), indent=1, default=str)
            tmp = self.rd / f".state.json.{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, self.rd / "state.json")
        except OSError as e:
            log.warning("cannot write state.json: %s", e)
        if node.phase != "adopting":
            write_records(self.rd, self.snapshots.records(node))
