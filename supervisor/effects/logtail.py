"""The line of a child's log worth putting in an error report."""
from __future__ import annotations

from pathlib import Path


def last_line(path: str | Path) -> str:
    """The last error line of the log's tail, else its last line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - 4096, 0))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    errors = [ln for ln in lines if " ERROR " in ln or "Error" in ln or "failed" in ln]
    return (errors or lines)[-1].strip()
