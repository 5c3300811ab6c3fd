"""`python -m engines --config-json '<EngineConfig JSON>'`: run one engine (all its TP ranks)."""
from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from wire.engine_config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines", description=__doc__)
    parser.add_argument("--config-json", required=True, help="an EngineConfig as a JSON object")
    ns = parser.parse_args(argv)
    try:
        cfg = EngineConfig.model_validate_json(ns.config_json)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        print(f"--config-json: {where}: {err['msg']}", file=sys.stderr)
        return 2
    return run(cfg)


def run(cfg: EngineConfig) -> int:
    """Configure logging for this engine and run it; returns the exit code."""
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(asctime)s {cfg.name} %(levelname)s %(name)s: %(message)s")
    from wire.lograte import install
    install()
    from .main import run_engine
    return run_engine(cfg)

