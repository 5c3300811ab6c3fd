"""Where the supervisor is: data/admin URLs, token and events endpoint, from flags or its config."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.state_file import read_state


class TargetError(ValueError):
    """The supervisor's addresses or token cannot be determined; one line saying why."""


@dataclass(frozen=True)
class Target:
    data_url: str
    admin_url: str
    token: str
    events_endpoint: str | None  # None: ask the supervisor (/status names its events socket)


def _read_token(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise TargetError(f"{path}: cannot read the admin token: {exc.strerror}") from None
    if not text:
        raise TargetError(f"{path}: admin token file is empty")
    return text


def _state_urls(runtime_dir: Path) -> tuple[str | None, str | None]:
    """The URLs a running supervisor wrote to state.json (needed when the config says port 0)."""
    state = read_state(runtime_dir) or {}
    return state.get("router_url"), state.get("admin_url")


def resolve_target(config: str | None, data_url: str | None, admin_url: str | None,
                   token_file: str | None, events: str | None) -> Target:
    """Flags win; the rest comes from the supervisor config (-c FILE, or its embedded default)."""
    from supervisor.config_load import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise TargetError(str(exc).splitlines()[0]) from None
    rd = cfg.resolved_runtime_dir()
    state_router, state_admin = _state_urls(rd)
    if data_url is None:
        data_url = state_router if cfg.router.port == 0 else f"http://{cfg.router.host}:{cfg.router.port}"
    if admin_url is None:
        admin_url = state_admin if cfg.admin.port == 0 else f"http://{cfg.admin.host}:{cfg.admin.port}"
    if data_url is None or admin_url is None:
        raise TargetError(f"the config uses port 0 and {rd}/state.json has no URLs: pass --data-url/--admin-url")
    token = _read_token(Path(token_file) if token_file else cfg.resolved_token_file())
    return Target(data_url=data_url, admin_url=admin_url, token=token, events_endpoint=events)
