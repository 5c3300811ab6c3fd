"""Which engines may still write the shared KV pool: a writer whose process began to exit stays
"unfenced" until its exit is read (its whole group gone, under TP), since a process's last kernels
outlive its last instruction. The primary hears `fenced` once none is left
(supervisor/core/kv_handover.py has the rest of the writer role's moves)."""
from __future__ import annotations

from supervisor.core.actions import Tell
from supervisor.core.model import Engine, Node


def writer_down(node: Node, e: Engine) -> None:
    """``e``'s process began to exit: if it held the pool, it is unfenced until reaped."""
    if e.kv_writer:
        node.unfenced.add(f"{e.name}:{e.incarnation}")
        e.kv_writer = False


def writer_reaped(node: Node, name: str, incarnation: int) -> None:
    """An exit was read: if it was the last unfenced writer, the primary may reuse the blocks that
    writer left unfinished."""
    key = f"{name}:{incarnation}"
    if key not in node.unfenced:
        return
    node.unfenced.discard(key)
    p = node.primary_engine()
    if p is not None and p.kv_writer and others_gone(node, p):
        node.emit(Tell(p.name, p.incarnation, "fenced"))


def others_gone(node: Node, writer: Engine) -> bool:
    """No engine but ``writer`` may still write the pool: none holds the role (one being fenced still
    does until its exit), and every one that exited was reaped."""
    return not node.unfenced and not any(e.kv_writer for e in node.engines.values() if e is not writer)
