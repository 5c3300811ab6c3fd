"""The supervisor a node benchmark starts for itself: the given config (or the embedded default)
with a private runtime dir, free ports and no flapping limit, so it never touches a production
instance; the options that choose it, and where progress lines go."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def bench_config(path: str | None, workdir: Path, args: argparse.Namespace) -> str:
    """The user's config with a private runtime dir, free ports, and no flapping limit."""
    from supervisor.config_load import load_config
    cfg = load_config(path).model_dump()
    cfg["runtime_dir"] = str(workdir / "rt")
    cfg["router"]["port"] = 0
    cfg["admin"]["port"] = 0
    cfg["admin"]["token_file"] = None
    cfg["failover"]["flap_max"] = max(cfg["failover"]["flap_max"], 4 * args.runs + 10)
    if args.preset:
        cfg["model"]["preset"] = args.preset
    if args.device:
        cfg["device"] = args.device
    if args.model:
        cfg["model"]["path"] = args.model
    return yaml.safe_dump(cfg)


def add_target_args(p: argparse.ArgumentParser) -> None:
    """The options that say which supervisor a bench starts (read by `bench_config`)."""
    p.add_argument("-c", "--config", help="supervisor config (default: the embedded default)")
    p.add_argument("--preset", choices=["tiny", "small", "1b"], help="built-in model preset (when model.path is null)")
    p.add_argument("--model", help="checkpoint folder (overrides model.path)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="the node's device (overrides device)")


def add_kill_args(p: argparse.ArgumentParser, victim: str, runs: int, settle: float) -> None:
    """The options of a bench that SIGKILLs `victim` `--runs` times under load."""
    p.add_argument("--runs", type=int, default=runs, help=f"{victim} kills (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (%(default)s)")
    p.add_argument("--settle", type=float, default=settle, help="seconds of load before each kill (%(default)s)")
    p.add_argument("--boot-timeout", type=float, default=900.0,
                   help="seconds the node may take to start, and to be all READY again after each kill")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def say(args: argparse.Namespace, msg: str) -> None:
    print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)
