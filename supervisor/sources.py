"""The event sources that are not an effect's answer: signals, the engines' control channel, and the
primary's exit poll. Each only records an event (the pass does the work; for a failover's events,
at once)."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from supervisor.core.events import Exited, Said, StopAsked
from supervisor.core.kv_handover import ANSWERS
from supervisor.core.model import Node
from supervisor.effects.control import EngineMessage
from wire.proc import is_exiting

log = logging.getLogger("understudy")

Record = Callable[..., None]  # (event, at_once=False): Arbiter.record


def on_signal(sig: int, record: Record) -> None:
    """SIGTERM/SIGINT stop the node; SIGHUP is only said (no config reload)."""
    name = signal.Signals(sig).name
    log.info("received %s", name)
    if sig in (signal.SIGTERM, signal.SIGINT):
        record(StopAsked(name))
    elif sig == signal.SIGHUP:
        log.info("SIGHUP: config reload is not supported; use `understudy rollout` to restart engines")


def said(msg: EngineMessage | None, record: Record) -> None:
    """A valid message from an engine (malformed ones are logged by the channel); an answer that a
    failover or a switchover waits on (promoted, demoted: kv_handover.py) has its pass at once."""
    if msg is not None:
        record(Said(msg.engine, msg.incarnation, msg.type, dict(msg.model_extra or {})), at_once=msg.type in ANSWERS)


async def primary_exit_poll(node: Node, period_s: float, record: Record) -> None:
    """Fail over as soon as the primary starts to exit, not when its pidfd fires after teardown
    (a GPU process spends ~100 ms in the kernel after SIGKILL): PF_EXITING, every ``period_s``."""
    told: int | None = None
    while True:
        await asyncio.sleep(period_s)
        p = node.primary_engine()
        try:
            exiting = p is not None and p.pid and p.pid != told and not node.stopping and is_exiting(p.pid)
        except OSError:  # e.g. EMFILE: the next poll tells (and the pidfd does anyway)
            continue
        if exiting:
            told = p.pid
            record(Exited(p.name, p.incarnation, p.pid, time.monotonic()), at_once=True)
