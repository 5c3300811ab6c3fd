"""CLI side of the admin API: URL and token from the same config (or state.json when port 0)."""
from __future__ import annotations

import json
import sys
from typing import Any

from supervisor.config_load import ConfigError, load_config


class ClientError(Exception):
    pass


def admin_endpoint(config_path: str | None) -> tuple[str, str]:
    """(admin base URL, token)."""
    from supervisor.token import TokenError, read_token
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        raise ClientError(f"invalid config: {e}") from None
    url = f"http://{cfg.admin.host}:{cfg.admin.port}"
    if cfg.admin.port == 0:  # the real port is in state.json
        state = cfg.resolved_runtime_dir() / "state.json"
        try:
            st = json.loads(state.read_text())
            url = st["admin_url"]
        except (OSError, ValueError, KeyError):
            raise ClientError(f"admin.port is 0 and {state} has no admin_url: is the supervisor running?") from None
        if st.get("stopped") or not _alive(st.get("pid")):
            raise ClientError(f"no supervisor is running for {cfg.resolved_runtime_dir()} "
                              f"(the last one, pid {st.get('pid')}, has exited)")
    try:
        token = read_token(cfg.resolved_token_file())
    except TokenError as e:
        raise ClientError(str(e)) from None
    return url, token


def call(config_path: str | None, method: str, path: str, timeout_s: float = 30.0) -> tuple[int, Any]:
    """One admin request; (status code, parsed JSON or text)."""
    import httpx
    url, token = admin_endpoint(config_path)
    try:
        r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ClientError(f"cannot reach the admin API at {url}: {type(e).__name__}: {e}") from None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def format_status(st: dict[str, Any]) -> str:
    """Human table for `understudy status`."""
    lines = [f"epoch {st['epoch']}  primary {st['primary'] or '-'}  {'DRAINED  ' if st['drained'] else ''}"
             f"router {st['router_url']}  admin {st['admin_url']}",
             f"model {st['model']['name']} ({st['model']['device']}, {st['model']['dtype']}, tp {st['model']['tp_size']})",
             "", f"{'ENGINE':8} {'ROLE':8} {'STATE':10} {'PID':>8} {'INC':>4}  {'WEIGHTS':18} REASON"]
    for e in st["engines"]:
        lines.append(f"{e['name']:8} {e['role']:8} {e['state']:10} {e['pid'] or '-':>8} {e['incarnation']:>4}  "
                     f"{(e['weights_source'] or '-')[:18]:18} {e['reason'][:60]}")
    for d in st["daemons"]:
        mb = f"{d['resident_bytes'] / 1e6:.1f} MB" if d["resident_bytes"] else "-"
        lines.append(f"{d['name']:17} {d['state']:10} {d['pid'] or '-':>8}  {mb}")
    for f in st["recent_failovers"][-5:]:
        lines.append(f"failover {f['from']} -> {f['to']} ({f['reason']}) {f['seconds'] * 1000:.1f} ms, epoch {f['epoch']}")
    return "\n".join(lines)


def run_command(config_path: str | None, method: str, path: str, as_json: bool, timeout_s: float = 30.0) -> int:
    """Call, print, map HTTP status to the exit code (0 ok, 1 refused, 2 unreachable)."""
    try:
        code, body = call(config_path, method, path, timeout_s)
    except ClientError as e:
        print(f"understudy: {e}", file=sys.stderr)
        return 2
    if code >= 400:
        msg = body.get("error") if isinstance(body, dict) else body
        print(f"understudy: {method} {path}: HTTP {code}: {msg}", file=sys.stderr)
        return 1
    if as_json or not (isinstance(body, dict) and "engines" in body):
        print(json.dumps(body, indent=2))
    else:
        print(format_status(body))
    return 0


def _alive(pid: object) -> bool:
    import os
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
