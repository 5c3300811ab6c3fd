"""The container's health check (deploy/Containerfile HEALTHCHECK): GET the data plane's /healthz at
the port the node's config gives (`router.port` of $UNDERSTUDY_CONFIG, as `understudy serve -c`
reads it), never a port written into the image. Exit 0 on a 200, 1 otherwise.

    python3 -m supervisor.healthcheck [-c CONFIG]"""
from __future__ import annotations

import argparse
import os
import sys
import urllib.request

from supervisor.config import UnderstudyConfig
from supervisor.config_load import ConfigError, load_config

TIMEOUT_S = 4.0


def health_url(cfg: UnderstudyConfig) -> str:
    """Where the supervisor answers /healthz, as seen from inside its own container."""
    host = cfg.router.host
    if host in ("0.0.0.0", "::", ""):  # (every address: the loopback one among them)
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{cfg.router.port}/healthz"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m supervisor.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=os.environ.get("UNDERSTUDY_CONFIG"),
                   help="the node's config (default: $UNDERSTUDY_CONFIG, else the embedded default)")
    args = p.parse_args(argv)
    try:
        url = health_url(load_config(args.config))
    except ConfigError as e:
        print(f"healthcheck: {e}", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:  # noqa: S310 (a URL of our own config)
            return 0 if r.status == 200 else 1
    except OSError as e:
        print(f"healthcheck: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
