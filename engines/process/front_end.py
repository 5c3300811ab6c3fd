"""The engine's HTTP front end: a process forked from rank 0 before CUDA, serving the OpenAI API
over the engine core (engines/core/core_link.py). It dies with the core (parent-death signal) and in
the same process group; signals are the core's to handle (it drains, then tells us to stop)."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal

from wire.engine_config import EngineConfig
from wire import event_loop, gc_pauses, node_secret
from wire.block_keys import key_root
from engines.frontend.engine_client import EngineClient
from engines.frontend.first_output import stamp_arrival
from wire.guarded_http import guarded_config
from wire.limits import BodyLimit
from wire.loopback import QuietServer
from engines.frontend.server import OpenAIServer, build_app
from engines.core.tokenizer import Tokenizer

log = logging.getLogger("engines.process.front_end")
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def run_frontend(cfg: EngineConfig, tokenizer: Tokenizer, model_names: list[str], max_model_len: int,
                 vocab_size: int, to_core: str, to_frontend: str, parent: int) -> int:
    """The child's body: wait for `serve`, listen, report the port, serve until `stop`."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # a group signal means "drain": the core decides (first:
        signal.signal(sig, signal.SIG_IGN)        # a drain asked as we start must not kill us)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the core died before prctl took effect
        return 1
    libc.prctl(_PR_SET_NAME, f"engine-{cfg.name}-http".encode()[:15], 0, 0, 0)
    return event_loop.run(_serve(cfg, tokenizer, model_names, max_model_len, vocab_size, to_core, to_frontend))


async def _serve(cfg: EngineConfig, tokenizer: Tokenizer, model_names: list[str], max_model_len: int,
                 vocab_size: int, to_core: str, to_frontend: str) -> int:
    client = EngineClient(to_core, to_frontend, (key_root(cfg.deterministic), cfg.kv_block_size))
    startup: dict = {}
    srv = OpenAIServer(client, tokenizer, model_names, max_model_len, vocab_size, lambda: startup, cfg.limits,
                       cfg.deterministic)
    app = stamp_arrival(BodyLimit(build_app(srv), cfg.limits.max_body_bytes))
    gate = node_secret.gate(node_secret.read(cfg.node_secret_file)) if cfg.node_secret_file else None
    server = QuietServer(guarded_config(app, cfg.listener, f"engine {cfg.name}", gate, host=cfg.host, port=cfg.port,
                                        log_level="warning", lifespan="off", access_log=False))
    go = asyncio.Event()

    def on_serve(msg: dict) -> None:
        startup.update(msg["startup"])
        go.set()
    client.on_serve = on_serve
    client.on_drain = lambda: setattr(srv, "accepting", False)
    client.on_stop = lambda: setattr(server, "should_exit", True)
    reader = asyncio.create_task(client.run())
    await asyncio.wait([reader, asyncio.create_task(go.wait())], return_when=asyncio.FIRST_COMPLETED)
    if reader.done():  # told to stop before serving
        return 0
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError(f"HTTP server did not start on {cfg.host}:{cfg.port}")
        await asyncio.sleep(0.002)
    client.ready(server.servers[0].sockets[0].getsockname()[1])
    gc_pauses.freeze_startup()
    await serving
    reader.cancel()
    return 0
