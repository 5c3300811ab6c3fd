"""Why the node does not serve, in one line for /readyz, `understudy status` and systemd's STATUS:
e.g. ``engine a: crash loop, next try in 30 s, last exit: exit code 1 (CheckpointError: ...)``."""
from __future__ import annotations

from collections.abc import Iterable

from supervisor.slots import EngineSlot
from supervisor.states import State

STARTING_STATES = frozenset({State.STARTING, State.ATTACHING, State.WARMING})


def engine_why(slot: EngineSlot, now: float) -> str | None:
    """What keeps this engine from serving; None for a READY one."""
    st = slot.state
    if st == State.READY:
        return None
    if st == State.BACKOFF:
        what = "crash loop" if slot.crash_loop else "restarting"
        wait = f", next try in {max(slot.retry_at - now, 0):.0f} s" if slot.retry_at is not None else ""
        return f"engine {slot.name}: {what}{wait}, last exit: {_exit_text(slot)}"
    if st == State.FATAL:
        return f"engine {slot.name}: FATAL: {slot.reason}"
    if st in STARTING_STATES:
        return f"engine {slot.name}: {st.value} for {now - slot.started_at:.0f} s (incarnation {slot.incarnation})"
    return f"engine {slot.name}: {st.value}" + (f": {slot.reason}" if slot.reason else "")


def not_ready_text(engines: Iterable[EngineSlot], now: float) -> str:
    """Every engine's obstacle, joined; empty when one is READY."""
    parts = [why for s in engines if (why := engine_why(s, now)) is not None]
    return "; ".join(parts)


def _exit_text(slot: EngineSlot) -> str:
    text = slot.last_exit or slot.reason or "unknown"
    line = slot.log_line
    if line and not line.startswith("("):  # "(no log)", "(empty log)" say nothing
        text += f" ({line[:200]})"
    return text
