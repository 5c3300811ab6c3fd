"""Self-healing: a standby that came up degraded while the daemons were away (weights read from disk,
a KV cache of its own: on a GPU a second copy of the weights and a second `kv_cache_bytes`) is
replaced, once every daemon is READY again, by one on the daemons' weights and pool. A primary that
maps the pool of a daemon since restarted (a failover to a standby on the new pool would recompute
every stream; on a GPU the old pool's memory stays held too) hands over to a READY standby on the
daemon's pool, and restarts. One at a time, only while a primary serves, never during a rollout or a
promotion."""
from __future__ import annotations

import logging

from supervisor.core import admin, engines
from supervisor.core.actions import Publish
from supervisor.core.model import Engine, Node
from supervisor.core.states import Role, State

log = logging.getLogger("understudy")


def degraded(node: Node, e: Engine) -> str | None:
    """How ``e`` runs without the daemons it should use, or None."""
    if node.settings.external or not node.daemons:
        return None
    if e.weights_source and e.weights_source.startswith("disk:") and e.weights_source != "disk:off":
        return f"weights {e.weights_source}"
    if node.settings.shared_kv and e.kv_source and e.kv_source.startswith("own"):
        return f"KV {e.kv_source}"
    return stale_pool(node, e)


def daemon_pool(node: Node) -> str | None:
    """The KV pool rank 0's daemon holds now (None: none known, or no shared KV)."""
    d = next((d for d in node.daemons if d.rank == 0), None)
    return d.kv_pool_id if d is not None and node.settings.shared_kv else None


def stale_pool(node: Node, e: Engine) -> str | None:
    """How ``e`` maps a KV pool its rank-0 daemon no longer holds (it started before that daemon's
    restart), or None."""
    pool = daemon_pool(node)
    if pool is None or e.kv_pool_id in (None, pool):
        return None
    return f"the KV pool {e.kv_pool_id[:8]} of daemon-rank0 before its restart (it holds {pool[:8]} now)"


def heal(node: Node) -> None:
    if not node.daemons or any(d.state != State.READY for d in node.daemons):
        return
    if node.primary is None or (node.rollout is not None and node.rollout.running) or node.promoting is not None \
            or node.demoting is not None:
        return
    if any(e.stop_requested for e in node.engines.values()):
        return  # (one at a time)
    daemons_back = max(d.state_since for d in node.daemons)
    for e in node.engines.values():
        # (one started after the daemons were READY again would come up the same way: it is left as it is)
        if e.role == Role.STANDBY and e.state == State.READY and e.started_at < daemons_back \
                and (why := degraded(node, e)) is not None:
            log.warning("%s: runs without the daemons' weights or pool (%s); every daemon is READY again: "
                        "replacing it with a standby on them", e.name, why)
            node.emit(Publish({"type": "healing", "engine": e.name, "degraded": why}))
            engines.stop(node, e, restart=True)
            return
    primary, standby = node.primary_engine(), node.ready_standby()
    if primary is not None and standby is not None and primary.state == State.READY \
            and (why := stale_pool(node, primary)) is not None and standby.kv_pool_id == daemon_pool(node):
        log.warning("%s: the primary maps %s: a switchover to %s, on the daemon's pool, then %s restarts",
                    primary.name, why, standby.name, primary.name)
        node.emit(Publish({"type": "healing", "engine": primary.name, "degraded": why}))
        admin.switch_over(node)
