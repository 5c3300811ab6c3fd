"""The harness's one reader of a supervisor's ``{runtime_dir}/state.json`` (the ``GET /status`` body,
written by atomic rename): where its data and admin ports really are when the config says port 0."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_state(runtime_dir: Path) -> dict[str, Any] | None:
    """The state a supervisor last wrote there, or None (missing, or not a JSON object)."""
    try:
        state = json.loads((Path(runtime_dir) / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None
