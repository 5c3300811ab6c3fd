"""Why the node does not serve, in one line for /readyz, `understudy status` and systemd's STATUS:
e.g. ``engine a: crash loop, next try in 30 s, last exit: exit code 1 (CheckpointError: ...)``."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from supervisor.core.states import State

if TYPE_CHECKING:
    from supervisor.core.model import Engine, Node

STARTING_STATES = frozenset({State.STARTING, State.ATTACHING, State.WARMING})


def engine_why(slot: "Engine", now: float) -> str | None:
    """What keeps this engine from serving; None for a READY one."""
    st = slot.state
    if st == State.READY:
        return None
    if st == State.BACKOFF:
        what = "crash loop" if slot.crash_loop else "restarting"
        wait = f", next try in {max(slot.retry_at - now, 0):.0f} s" if slot.retry_at is not None else ""
        return f"engine {slot.name}: {what}{wait}, last exit: {_exit_text(slot)}"
    if st == State.FATAL:
        wait = f" (next try in {max(slot.retry_at - now, 0):.0f} s)" if slot.retry_at is not None else ""
        return f"engine {slot.name}: FATAL{wait}: {slot.reason}"
    if st in STARTING_STATES:
        return f"engine {slot.name}: {st.value} for {now - slot.started_at:.0f} s (incarnation {slot.incarnation})"
    return f"engine {slot.name}: {st.value}" + (f": {slot.reason}" if slot.reason else "")


def not_ready_text(engines: Iterable["Engine"], now: float) -> str:
    """Every engine's obstacle, joined; empty when one is READY."""
    parts = [why for s in engines if (why := engine_why(s, now)) is not None]
    return "; ".join(parts)


def not_ready_reason(node: "Node", now: float) -> str:
    """Why there is no primary: the last event (boot, failover), then each engine's obstacle."""
    detail = not_ready_text(node.engines.values(), now)
    return f"{node.hold_reason}; {detail}" if detail else node.hold_reason


def roles_text(node: "Node") -> str:
    """systemd's STATUS line: ``epoch 3: a=primary/READY b=standby/STARTING``, and why not ready."""
    parts = [f"{s.name}={s.role.value}/{s.state.value}" for s in node.engines.values()]
    drained = " drained" if node.drained else ""
    why = "" if node.primary is not None else f"; not ready: {not_ready_reason(node, node.now)}"
    return (f"epoch {node.epoch}: " + " ".join(parts) + drained + why)[:400]


def _exit_text(slot: "Engine") -> str:
    text = slot.last_exit or slot.reason or "unknown"
    line = slot.log_line
    if line and not line.startswith("("):  # "(no log)", "(empty log)" say nothing
        text += f" ({line[:200]})"
    return text
