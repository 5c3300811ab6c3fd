"""Self-healing: a standby that came up degraded while the daemons were away (weights read from disk,
a KV cache of its own: on a GPU a second copy of the weights and a second `kv_cache_bytes`) is
replaced, once every daemon is READY again, by one on the daemons' weights and pool. One at a time,
only while a primary serves, never during a rollout or a promotion."""
from __future__ import annotations

import logging

from supervisor.core import engines
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
    return None


def heal(node: Node) -> None:
    if not node.daemons or any(d.state != State.READY for d in node.daemons):
        return
    if node.primary is None or node.rollout is not None or node.promoting is not None or node.demoting is not None:
        return
    if any(e.stop_requested for e in node.engines.values()):
        return  # (one at a time)
    daemons_back = max(d.state_since for d in node.daemons)
    for e in node.engines.values():
        # (one started after the daemons were READY again would come up the same way: it is left as it is)
        if e.role == Role.STANDBY and e.state == State.READY and e.started_at < daemons_back \
                and (why := degraded(node, e)) is not None:
            log.warning("%s: came up degraded (%s) while the daemons were away; every daemon is READY again: "
                        "replacing it with a standby on the daemons' weights and pool", e.name, why)
            node.emit(Publish({"type": "healing", "engine": e.name, "degraded": why}))
            engines.stop(node, e, restart=True)
            return
