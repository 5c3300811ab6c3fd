"""`understudy serve`: config -> checks -> Supervisor.run(); boot errors exit non-zero with one line."""
from __future__ import annotations

import logging
import sys

from pydantic import ValidationError

from supervisor import preflight
from supervisor.config import UnderstudyConfig
from supervisor.config_load import ConfigError, format_errors, load_config

log = logging.getLogger("understudy")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s understudy %(levelname)s %(message)s")
    from supervisor.lograte import install
    install()  # a flood of one message (EMFILE, a broken peer) becomes a few lines and a count; transitions all pass
    for noisy in ("httpx", "httpcore", "uvicorn.error"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_serve_config(config_path: str | None, port: int | None = None,
                      admin_port: int | None = None) -> UnderstudyConfig:
    """The config ``serve`` runs with: the file (or the embedded default), then ``--port`` and
    ``--admin-port`` over ``router.port`` and ``admin.port``, validated again as a whole."""
    cfg = load_config(config_path)
    if port is None and admin_port is None:
        return cfg
    data = cfg.model_dump()
    if port is not None:
        data["router"]["port"] = port
    if admin_port is not None:
        data["admin"]["port"] = admin_port
    try:
        return UnderstudyConfig.model_validate(data)
    except ValidationError as e:
        source = f"{config_path or '<embedded default>'} with --port/--admin-port"
        raise ConfigError("\n".join(f"{source}: {line}" for line in format_errors(e))) from None


def check_only(config_path: str | None, port: int | None, admin_port: int | None) -> int:
    """``serve --check``: everything serve checks before starting a child, and nothing started."""
    try:
        cfg = load_serve_config(config_path, port, admin_port)
        plan = preflight.check(cfg, config_path or "<embedded default>", make_model=False)
    except ConfigError as e:
        print(f"understudy: invalid config: {e}", file=sys.stderr)
        return 2
    model = plan.model_path or f"the built-in {cfg.model.preset} model (made on first run)"
    print(f"config OK: data plane {cfg.router.host}:{cfg.router.port}, admin {cfg.admin.host}:{cfg.admin.port}, "
          f"{cfg.engines.count} engines of {model} on {plan.device} (whether the two ports are free is not "
          "checked: a running node or systemd's socket may hold them; serve binds them first and exits 2 naming "
          "one in use)")
    return 0


def serve(config_path: str | None, port: int | None = None, admin_port: int | None = None) -> int:
    """Run the supervisor in the foreground (``port``, ``admin_port``: over the config's); the exit code:
    2 for anything in the config or around it (the message names the key), which a restart will not fix."""
    from supervisor.node import Supervisor
    from supervisor.errors import BootError
    from supervisor.effects.servers import BindError
    from supervisor.model_prep import ModelError
    from wire.secret_file import TokenError
    try:
        cfg = load_serve_config(config_path, port, admin_port)
    except ConfigError as e:
        print(f"understudy: invalid config: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    try:
        plan = preflight.check(cfg, config_path or "<embedded default>", make_model=True)
        sup = Supervisor(cfg, plan.model_path, plan.device)
        sup.prepare()
    except ConfigError as e:
        print(f"understudy: invalid config: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:  # a child's config built from ours (preflight builds them too: a bug)
        print("understudy: invalid config: " + "; ".join(format_errors(e)), file=sys.stderr)
        return 2
    except (ModelError, BindError, BootError, TokenError) as e:
        print(f"understudy: {e}", file=sys.stderr)
        return 2
    log.info("runtime dir %s, model %s on %s, %d engines", sup.rd, sup.model_path, sup.device, len(sup.node.engines))
    from wire import event_loop, gc_pauses
    gc_pauses.watch().observers.append(sup.metrics.observe_gc)
    gc_pauses.freeze_startup()
    sup.when_serving.append(gc_pauses.freeze_startup)  # (and what the loop made until then: its servers, apps)
    rc = event_loop.run(sup.run())
    log.debug("event loop closed")
    return rc
