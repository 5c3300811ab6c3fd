"""The node as ``GET /status`` and ``state.json`` show it (docs/CONTRACTS.md): built from the node
and what does not change while it runs (URLs, runtime dir, model)."""
from __future__ import annotations

import os
from typing import Any

from supervisor.core.model import Engine, Node
from supervisor.core.states import State
from supervisor.core.healing import stale_pool
from supervisor.core.why import not_ready_reason


def status_view(node: Node, fixed: dict[str, Any], now: float) -> dict[str, Any]:
    """``fixed``: router_url, admin_url, runtime_dir, events, token_file, model (set at boot)."""
    sp = node.spawn
    return {
        "pid": os.getpid(), "epoch": node.epoch, "primary": node.primary,
        "drained": node.drained, "stopping": node.stopping, "stopped": node.finished,
        **fixed,
        "engines": [{**engine_view(s, now), "kv_pool_stale": stale_pool(node, s)} for s in node.engines.values()],
        "daemons": [{"name": d.name, "rank": d.rank, "state": d.state.value, "pid": d.pid,
                     "resident_bytes": d.resident_bytes, "fingerprint": d.fingerprint,
                     "weights_finite": d.weights_finite, "kv_pool": d.kv_pool, "kv_pool_id": d.kv_pool_id,
                     "socket": d.socket_path, "reason": d.reason, "last_exit": d.last_exit}
                    for d in node.daemons],
        "spawn_server": {"pid": sp.pid} if sp is not None and sp.pid and sp.state == State.READY else None,
        "recent_failovers": list(node.failovers)[-10:],
        "rollout": node.rollout.view() if node.rollout is not None else None,
        "not_ready": None if node.primary is not None else not_ready_reason(node, now),
        "kv_handover": _handover(node),
        "watchdog": {"stuck": node.stuck, "stuck_after_s": node.watchdog.stuck_after_s,
                     "since_progress_s": round(now - node.watchdog.last_progress, 3)},
    }


def _handover(node: Node) -> dict[str, Any] | None:
    """A move of the shared KV pool's writer role under way (supervisor/core/kv_handover.py)."""
    if node.promoting is not None:
        return {"promoting": node.promoting.name, "reason": node.promoting.reason}
    if node.demoting is not None:
        return {"demoting": node.demoting.name, "successor": node.demoting.successor}
    return None


def engine_view(s: Engine, now: float) -> dict[str, Any]:
    return {"name": s.name, "role": s.role.value, "state": s.state.value, "pid": s.pid,
            "incarnation": s.incarnation, "url": s.url or None,
            "weights_source": s.weights_source, "startup_phases": s.phases,
            "kv_source": s.kv_source, "kv_mode": s.heartbeat.get("kv_mode"), "kv_writer": s.kv_writer,
            "kv_pool_id": s.kv_pool_id,
            "deterministic": s.heartbeat.get("deterministic"),
            "state_for_s": round(now - s.state_since, 3),
            "heartbeat_age_s": round(now - s.last_heartbeat, 3) if s.last_heartbeat else None,
            "heartbeat": dict(s.heartbeat), "reason": s.reason,
            "last_exit": s.last_exit, "recent_failures": len(s.policy.failures),
            "crash_loop": s.crash_loop, "fatal_retries": s.fatal_retries,
            "next_try_in_s": round(max(s.retry_at - now, 0.0), 3) if s.retry_at is not None else None}
