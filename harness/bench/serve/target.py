"""What is being measured: the endpoint URL and model, and what the static decode needs to run the
same model the same way (checkpoint folder, device, dtype, max_model_len, kernels). Taken from the
supervisor's config and admin API (`-c`), from the endpoint (GET /v1/models), and from options."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.state_file import read_state


class TargetError(Exception):
    """The target cannot be benchmarked as asked; str() says why."""


@dataclass
class Target:
    url: str
    model: str = ""
    max_model_len: int | None = None
    vocab: int | None = None
    model_dir: str | None = None
    device: str | None = None
    dtype: str | None = None
    max_num_seqs: int | None = None
    cuda_graphs: bool = True
    fused_kernels: bool = True
    metrics_sources: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (url, headers)
    admin_metrics_lag_s: float = 0.0  # wait this long after a point before reading the supervisor's counters
    notes: list[str] = field(default_factory=list)


def _router_url(cfg, config_path: str | None) -> str:  # noqa: ANN001
    if cfg.router.port == 0:  # the real port is in state.json
        rd = cfg.resolved_runtime_dir()
        st = read_state(rd) or {}
        if not st.get("router_url"):
            raise TargetError(f"router.port is 0 and {rd / 'state.json'} has no router_url: is the supervisor of "
                              f"{config_path or 'the default config'} running?")
        if st.get("stopped"):
            raise TargetError(f"the supervisor of {config_path or 'the default config'} has stopped "
                              f"({rd / 'state.json'} says so): nothing to measure")
        return st["router_url"]
    host = "127.0.0.1" if cfg.router.host in ("0.0.0.0", "::", "") else cfg.router.host
    return f"http://{host}:{cfg.router.port}"


def resolve(args: argparse.Namespace) -> Target:
    """The target from `-c`/`--url` and the override options; never guesses what it cannot read."""
    from supervisor.admin.client import ClientError, admin_endpoint
    from supervisor.config_load import ConfigError, load_config

    use_config = args.config is not None or args.url is None
    t = Target(url=(args.url or "").rstrip("/"))
    if use_config:
        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            raise TargetError(f"invalid config: {e}") from None
        if not t.url:
            t.url = _router_url(cfg, args.config)
        e = cfg.engines
        t.max_model_len, t.max_num_seqs = e.max_model_len, e.max_num_seqs
        t.cuda_graphs, t.fused_kernels = e.cuda_graphs, e.fused_kernels
        t.dtype = cfg.model.dtype
        try:
            admin, token = admin_endpoint(args.config)
            auth = {"Authorization": f"Bearer {token}"}
            st = httpx.get(admin + "/status", headers=auth, timeout=10).raise_for_status().json()
            t.model_dir, t.device, t.model = st["model"]["path"], st["model"]["device"], st["model"]["name"]
            primary = next((e for e in st["engines"] if e["name"] == st["primary"] and e.get("url")), None)
            if primary:  # the engine's own counters are exact; the supervisor's lag by a heartbeat
                from wire import node_secret  # (the engine answers its node only)
                t.metrics_sources.append((primary["url"] + "/metrics", node_secret.headers(st["runtime_dir"])))
            t.metrics_sources.append((admin + "/metrics", auth))
            t.admin_metrics_lag_s = 2 * e.heartbeat_interval_s
        except (ClientError, httpx.HTTPError, KeyError, ValueError) as err:
            t.notes.append(f"admin API not used ({err}); the static decode needs --model-dir")
    if args.metrics_url:
        t.metrics_sources.insert(0, (args.metrics_url, {}))
    t.metrics_sources.append((t.url + "/metrics", {}))  # an engine's own endpoint serves it
    _from_models(t, args.model is None)
    for name in ("model", "model_dir", "device", "dtype", "max_model_len", "max_num_seqs", "vocab"):
        if getattr(args, name, None) is not None:
            setattr(t, name, getattr(args, name))
    if args.no_cuda_graphs:
        t.cuda_graphs = False
    if args.no_fused_kernels:
        t.fused_kernels = False
    if t.vocab is None and t.model_dir:
        t.vocab = vocab_of(t.model_dir)
    if not t.model:
        raise TargetError(f"no model name: GET {t.url}/v1/models did not tell it; give --model")
    return t


def _from_models(t: Target, need_name: bool) -> None:
    """Model id and max_model_len from GET /v1/models (when the endpoint answers)."""
    try:
        data = httpx.get(t.url + "/v1/models", timeout=10).raise_for_status().json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
        t.notes.append(f"GET {t.url}/v1/models failed: {type(e).__name__}: {e}")
        return
    if need_name and not t.model:
        t.model = str(data.get("id") or "")
    if isinstance(data.get("max_model_len"), int):
        t.max_model_len = data["max_model_len"]


def vocab_of(model_dir: str) -> int:
    """vocab_size from the checkpoint's config.json."""
    path = Path(model_dir) / "config.json"
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TargetError(f"{path}: cannot read vocab_size ({type(e).__name__}: {e}); give --vocab") from None


def note(msg: str) -> None:
    print(f"bench serve: {msg}", file=sys.stderr, flush=True)
