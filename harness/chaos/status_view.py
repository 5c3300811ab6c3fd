"""Read the admin /status JSON into StatusSample, tolerating list- or dict-shaped sections."""
from __future__ import annotations

from typing import Any

from .records import EngineView, StatusSample


def _items(section: Any, key_name: str) -> list[dict[str, Any]]:
    """A list of dicts from a list, or from a {name: dict} mapping (name put under key_name)."""
    if isinstance(section, list):
        return [x for x in section if isinstance(x, dict)]
    if isinstance(section, dict):
        return [{key_name: k, **v} for k, v in section.items() if isinstance(v, dict)]
    return []


def _pid(item: dict[str, Any]) -> int | None:
    pid = item.get("pid")
    return pid if isinstance(pid, int) and pid > 0 else None


def _daemon_name(item: dict[str, Any]) -> str:
    if item.get("name"):
        return str(item["name"])
    return f"daemon-rank{item.get('rank', '?')}"


def parse_status(body: dict[str, Any], t: float) -> StatusSample:
    """Engines (name, role, state, pid), daemons (name or rank, pid, state) and the epoch."""
    engines = [
        EngineView(
            name=str(e.get("name", "?")),
            kind="engine",
            role=e.get("role"),
            state=e.get("state"),
            pid=_pid(e),
            incarnation=e.get("incarnation") if isinstance(e.get("incarnation"), int) else None,
            weights_source=e.get("weights_source") if isinstance(e.get("weights_source"), str) else None,
        )
        for e in _items(body.get("engines"), "name")
    ]
    daemons = [
        EngineView(name=_daemon_name(d), kind="daemon", role=None, state=d.get("state"), pid=_pid(d))
        for d in _items(body.get("daemons"), "name")
    ]
    epoch = body.get("epoch")
    return StatusSample(t=t, epoch=epoch if isinstance(epoch, int) else None, engines=engines, daemons=daemons,
                        supervisor_pid=supervisor_pid(body), spawn_server_pid=_pid(body.get("spawn_server") or {}))


def supervisor_pid(body: dict[str, Any]) -> int | None:
    """The supervisor's own pid if /status reports it (`pid` or `supervisor.pid`)."""
    sup = body.get("supervisor")
    for candidate in (body.get("pid"), sup.get("pid") if isinstance(sup, dict) else None):
        if isinstance(candidate, int) and candidate > 0:
            return candidate
    return None


def events_endpoint(body: dict[str, Any]) -> str | None:
    """The events PUB endpoint /status names (`events`, else from `runtime_dir`)."""
    if isinstance(body.get("events"), str):
        return body["events"]
    if isinstance(body.get("runtime_dir"), str):
        return f"ipc://{body['runtime_dir']}/events.sock"
    return None
