"""CLI side of the admin API: URL and token from the same config, or from the running supervisor's
state.json (its real admin URL and token file, wherever its runtime dir is)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from supervisor.config import UnderstudyConfig
from supervisor.config_load import ConfigError, load_config


class ClientError(Exception):
    pass


SYSTEM_CONFIG = "/etc/understudy/understudy.yaml"  # where configs/understudy.service points
SYSTEM_RUNTIME_DIR = "/run/understudy"  # RuntimeDirectory= of configs/understudy.service


def config_path_for_cli(config_path: str | None) -> str | None:
    """``-c``, else $UNDERSTUDY_CONFIG, else the systemd unit's config if present, else the embedded default."""
    if config_path:
        return config_path
    if os.environ.get("UNDERSTUDY_CONFIG"):
        return os.environ["UNDERSTUDY_CONFIG"]
    return SYSTEM_CONFIG if Path(SYSTEM_CONFIG).is_file() else None


def find_state(cfg: UnderstudyConfig) -> tuple[Path, dict[str, Any] | None, str | None]:
    """The runtime dir of the running supervisor and its state.json (None if none runs), and if none
    runs, what the last one's state.json says of it. With ``runtime_dir: null`` the supervisor's dir
    depends on ITS environment ($XDG_RUNTIME_DIR, e.g. /run under systemd), so the caller's own default
    and the systemd one are both looked at."""
    dirs = [cfg.resolved_runtime_dir()]
    if not cfg.runtime_dir:
        dirs += [Path(SYSTEM_RUNTIME_DIR), Path(f"/tmp/understudy-{os.getuid()}")]
    last = None
    for rd in dict.fromkeys(dirs):
        try:
            st = json.loads((rd / "state.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(st, dict):
            continue
        if not st.get("stopped") and _alive(st.get("pid")):
            return rd, st, None
        last = last or (f"the last supervisor of {rd} (pid {st.get('pid')}, admin {st.get('admin_url')}) "
                        f"{'stopped' if st.get('stopped') else 'is gone'}")
    return dirs[0], None, last


def admin_endpoint(config_path: str | None) -> tuple[str, str]:
    """(admin base URL, token): the config's, or the running supervisor's state.json (real port, token file)."""
    from wire.secret_file import TokenError, read_token
    try:
        cfg = load_config(config_path_for_cli(config_path))
    except ConfigError as e:
        raise ClientError(f"invalid config: {e}") from None
    rd, st, last = find_state(cfg)
    if last is not None:
        raise ClientError(f"no supervisor is running here: {last}; start one with `understudy serve`")
    url = f"http://{cfg.admin.host}:{cfg.admin.port}"
    if st is not None and st.get("admin_url"):
        url = st["admin_url"]
    elif cfg.admin.port == 0:
        raise ClientError(f"admin.port is 0 and no running supervisor wrote {rd / 'state.json'}: "
                          "is the supervisor running (with this config: -c)?")
    # a token file the config names wins (DESIGN §5: the same config); else the running supervisor's
    token_file = cfg.resolved_token_file() if cfg.admin.token_file else (
        Path(st["token_file"]) if st and st.get("token_file") else rd / "admin.token")
    if st is None and not token_file.exists():
        raise ClientError(f"no supervisor is running here (no live one wrote {rd / 'state.json'}): start one with "
                          "`understudy serve`, or name its config with -c")
    try:
        token = read_token(token_file)
    except TokenError as e:
        raise ClientError(str(e)) from None
    return url, token


def print_token(config_path: str | None, as_json: bool = False) -> int:
    """`understudy token`: the admin token on stdout, for curl and friends; ``as_json``:
    ``{"admin_url", "token"}``, all a script needs to call the admin API."""
    try:
        url, token = admin_endpoint(config_path)
    except ClientError as e:
        print(f"understudy: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"admin_url": url, "token": token}) if as_json else token)
    return 0


CONNECT_TIMEOUT_S = 5.0
IDEMPOTENT = frozenset({"/admin/drain", "/admin/undrain"})  # POSTs asked again after a connection closed unanswered


def call(config_path: str | None, method: str, path: str, timeout_s: float = 30.0) -> tuple[int, dict[str, Any]]:
    """One admin request: (status code, its JSON object). ClientError when nothing answers, the
    answer does not come within ``timeout_s``, or what answers is not our admin API."""
    import httpx
    url, token = admin_endpoint(config_path)
    ask = lambda: httpx.request(method, url + path, headers={"Authorization": f"Bearer {token}"},  # noqa: E731
                                timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))
    try:
        try:
            r = ask()
        except httpx.RemoteProtocolError:
            if method != "GET" and path not in IDEMPOTENT:
                raise
            # Closed before any answer: a listener at its connection cap closes an idle connection to
            # make room, and one accepted before its request's bytes came counts as idle (a local hog
            # reconnecting whenever closed: wire/connection_share.py). Asking again is harmless.
            r = ask()
    except httpx.ConnectError as e:
        raise ClientError(f"cannot reach the admin API at {url}: {e} (is the supervisor running, with this "
                          "config: -c?)") from None
    except httpx.TimeoutException as e:
        what = "no connection" if isinstance(e, httpx.ConnectTimeout) else "connected, but no answer"
        limit = CONNECT_TIMEOUT_S if isinstance(e, httpx.ConnectTimeout) else timeout_s
        raise ClientError(f"the admin API at {url}: {what} within {limit:g}s ({method} {path})") from None
    except httpx.HTTPError as e:
        raise ClientError(f"cannot reach the admin API at {url}: {type(e).__name__}: {e}") from None
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        kind = r.headers.get("content-type", "no content type").split(";")[0]
        raise ClientError(f"{url} answered {method} {path} with HTTP {r.status_code} ({kind}), not a JSON "
                          "object: not an understudy admin API (is admin.port right?)")
    return r.status_code, body


def format_status(st: dict[str, Any]) -> str:
    """Human table for `understudy status`."""
    lines = [f"epoch {st['epoch']}  primary {st['primary'] or '-'}  {'DRAINED  ' if st['drained'] else ''}"
             f"router {st['router_url']}  admin {st['admin_url']}",
             f"model {st['model']['name']} ({st['model']['device']}, {st['model']['dtype']}, tp {st['model']['tp_size']}"
             f"{', deterministic' if st['model'].get('deterministic') else ''})",
             "", f"{'ENGINE':8} {'ROLE':8} {'STATE':10} {'PID':>8} {'INC':>4}  {'WEIGHTS':18} {'KV':14} REASON"]
    for e in st["engines"]:  # (a reason too long for its column is printed whole below the table)
        reason = e["reason"]
        if pending := (e.get("heartbeat") or {}).get("cuda_graphs_pending"):
            reason = f"{pending} CUDA graphs to capture" + (f"; {reason}" if reason else "")
        reason = reason if len(reason) <= 60 else reason[:57] + "..."
        kv = "stale pool" if e.get("kv_pool_stale") else e.get("kv_mode") or e.get("kv_source") or "-"
        lines.append(f"{e['name']:8} {e['role']:8} {e['state']:10} {e['pid'] or '-':>8} {e['incarnation']:>4}  "
                     f"{(e['weights_source'] or '-')[:18]:18} {kv[:14]:14} {reason}")
    for d in st["daemons"]:
        mb = f"{d['resident_bytes'] / 1e6:.1f} MB" if d["resident_bytes"] else "-"
        lines.append(f"{d['name']:17} {d['state']:10} {d['pid'] or '-':>8}  {mb}")
    for f in st["recent_failovers"][-5:]:
        lines.append(f"failover {f['from']} -> {f['to']} ({f['reason']}) {f['seconds'] * 1000:.1f} ms, epoch {f['epoch']}")
    if st.get("not_ready"):
        lines += ["", f"NOT READY: {st['not_ready']}"]
    if (st.get("watchdog") or {}).get("stuck"):
        lines.append(f"STUCK: no progress for {st['watchdog']['since_progress_s']:.0f}s: the systemd watchdog "
                     "is no longer fed")
    for e in st["engines"]:
        if len(e["reason"]) > 60:
            lines.append(f"{e['name']}: {e['reason']}")
    return "\n".join(lines)


def run_command(config_path: str | None, method: str, path: str, as_json: bool, timeout_s: float = 30.0) -> int:
    """Call, print, map HTTP status to the exit code (0 ok, 1 refused, 2 unreachable)."""
    try:
        code, body = call(config_path, method, path, timeout_s)
    except ClientError as e:
        print(f"understudy: {e}", file=sys.stderr)
        return 2
    if code >= 400:
        print(f"understudy: {method} {path}: HTTP {code}: {body.get('error', body)}", file=sys.stderr)
        return 1
    if path == "/status" and not STATUS_KEYS <= body.keys():
        print(f"understudy: GET /status answered without {', '.join(sorted(STATUS_KEYS - body.keys()))}: "
              "not an understudy admin API (is admin.port right?)", file=sys.stderr)
        return 2
    print(json.dumps(body, indent=2) if as_json or path != "/status" else format_status(body))
    return 0


STATUS_KEYS = {"epoch", "primary", "drained", "router_url", "admin_url", "model", "engines", "daemons",
               "recent_failovers"}  # what format_status reads


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
