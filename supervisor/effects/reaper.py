"""Reap: the exit status of an exited child, once its group is gone when asked (the other TP ranks
were SIGKILLed: they release GPU memory first), with the telling line of its log, and an engine's
link sockets removed; the boot's sweep of link sockets dead engines left; and the orphans nobody
waits for (engines re-parented to us when their spawn server died)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from wire.link_sockets import LINK_SOCKET, remove_sockets
from supervisor.core.actions import Reap, SweepLinks
from supervisor.core.events import ExitRead
from supervisor.effects.launcher import Launcher, log_path
from supervisor.effects.logtail import last_line
from supervisor.effects.pidwatch import foreign_exit, reap_orphans
from supervisor.effects.processes import group_alive, kill_group

log = logging.getLogger("understudy")

GROUP_GONE_WAIT_S = 10.0


class Reaper:
    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.pending: set[int] = set()  # exited children whose status is still being read

    def reap(self, a: Reap) -> Coroutine[Any, Any, ExitRead]:
        """The pid is ours to wait for from now on (the orphan reaper leaves it alone)."""
        self.pending.add(a.pid)
        return self._reap(a)

    async def _reap(self, a: Reap) -> ExitRead:
        handle = self.launcher.handles.pop(a.pid, None)
        try:
            rc = await handle.returncode() if handle is not None else None
        finally:
            self.pending.discard(a.pid)
        if a.wait_group:
            await wait_groups_gone([a.pid], GROUP_GONE_WAIT_S)
        if a.kind == "engine":
            self.remove_links(a.pid)
        logf = log_path(self.launcher.rd, a.kind, a.name, a.incarnation)
        return ExitRead(a.name, a.incarnation, a.pid, rc, last_line(logf), str(logf))

    def remove_links(self, pid: int) -> None:
        """An exited engine's link sockets (left if it died before its front end connected), unless
        its pid already names a new process (whose sockets they may be)."""
        if not foreign_exit(pid)[0]:
            log.debug("pid %d runs again (reused): its link sockets are left to the boot's sweep", pid)
            return
        for path in remove_sockets(self.launcher.rd, pid):
            log.info("removed %s, left by engine pid %d", path.name, pid)

    def sweep_links(self, a: SweepLinks) -> None:
        """Every engine link socket in the runtime dir but those of live adopted engines."""
        keep = set(a.keep)
        for path in self.launcher.rd.glob("eng-*-*.sock"):
            m = LINK_SOCKET.fullmatch(path.name)
            if m is None or int(m.group(1)) in keep:
                continue
            try:
                path.unlink()
                log.info("removed %s, left by a dead engine", path.name)
            except FileNotFoundError:
                pass

    def orphans(self, known: set[int]) -> None:
        """Reap exited children that nobody else waits for (adopted orphans)."""
        for pid, rc in reap_orphans(known | self.pending):
            log.debug("reaped adopted process %d (%s)", pid, rc)


async def wait_groups_gone(pgids: list[int], timeout_s: float) -> None:
    """Until no process lives in these groups (SIGKILLed again meanwhile), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for pgid in pgids:
        while await asyncio.to_thread(group_alive, pgid):
            if time.monotonic() > deadline:
                log.warning("process group %d still alive %.0fs after SIGKILL", pgid, timeout_s)
                break
            kill_group(pgid)
            await asyncio.sleep(0.05)
