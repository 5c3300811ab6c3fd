"""Who holds a listener's connections, and which one closes to make room (wire/guarded_http.py).

A *peer* is a client address (wire/guarded_http.py ``peer_of``: the remote IPv4 address, or the
/64 of an IPv6 one, which one host may hold whole). It is the only identity a connection has before
it sends anything, and it is coarse: every client of a loopback listener is 127.0.0.1, and every
client behind a proxy is the proxy (``peer_share`` 1 there: no share, only the order below). So the
share bounds what one remote host takes; what keeps an operator in on a shared address is the
order in which connections are closed, and authentication (the admin API).

Each peer may hold ``peer_share`` of the cap in unauthenticated connections; an authenticated one
(the listener's gate said so: the admin API's bearer token) no longer counts towards its peer's
share and is never closed to make room. A new connection from a peer at its share closes one of
that peer's idle connections (no request in progress); on a full listener, one of the peer with
the most; with none idle, the new one is refused. Idle connections go in this order, each class
oldest first: those whose request was refused (the admin API's 401), only waiting to close; then
*silent* ones (nothing received since they connected); then *talkers* (idle between keep-alive
requests, or mid-head). A client that sends its request as it connects is a talker from its
accept on (its bytes are already waiting), so a flood of silent connections from its own address
(a local hog) never closes it before its request is read. So a client that reconnects whenever
closed cycles through its own share, everyone else keeps the rest, and an authenticated request
finds a slot unless authenticated or busy connections hold the whole cap (on the admin API an
unauthenticated request is busy only while it is answered: every path but the static /ui needs
the token). Every operation is O(1), except making room on a full listener (O(peers)).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

_SILENT, _TALKER = 0, 1


class Occupancy:
    """The bookkeeping of one listener; ``peer_share`` None: a plain cap (no peers, nothing closed)."""

    def __init__(self, cap: int, peer_share: float | None) -> None:
        self.cap, self.fair = cap, peer_share is not None
        self.peer_cap = cap if peer_share is None else max(1, int(cap * peer_share))
        self.total = 0
        self._peer: dict[Hashable, str] = {}  # connection -> its peer
        self._heard: set[Hashable] = set()  # connections that have sent something
        self._trusted: set[Hashable] = set()
        self._unauth: dict[str, int] = {}  # peer -> its connections not authenticated
        self._idle: dict[str, tuple[OrderedDict, OrderedDict]] = {}  # peer -> its idle ones: (silent, talkers)

    def pressed(self, peer: str) -> bool:
        """A new connection from ``peer`` would have to make room (or be refused)."""
        return self.total >= self.cap or (self.fair and self._unauth.get(peer, 0) >= self.peer_cap)

    def admit(self, conn: Hashable, peer: str, talking: bool = False) -> tuple[bool, Hashable | None]:
        """A new connection (``talking``: its first bytes already wait): (admitted, the idle
        connection to close to make room for it, if any)."""
        victim = self.victim(peer)
        if self.pressed(peer) and victim is None:
            return False, None
        if victim is not None:
            self.release(victim)
        self.total += 1
        self._peer[conn] = peer
        self._unauth[peer] = self._unauth.get(peer, 0) + 1
        if talking:
            self._heard.add(conn)
        self.idle(conn)
        return True, victim

    def victim(self, peer: str) -> Hashable | None:
        """The idle connection a new one from ``peer`` would close, if it must make room."""
        if self.fair and self._unauth.get(peer, 0) >= self.peer_cap:
            return self._first_idle(peer)
        if self.total >= self.cap and self.fair and self._idle:
            biggest = max(self._idle, key=self.held)  # (of the peers with an idle connection)
            if self.held(biggest) > self.held(peer):  # never a smaller (or equal) peer's for a bigger one's
                return self._first_idle(biggest)
        return None

    def silent(self, conn: Hashable) -> bool:
        """``conn`` has sent nothing that was read (its bytes may wait unread: ask its socket)."""
        return conn not in self._heard

    def heard(self, conn: Hashable) -> None:
        """``conn`` sent its first bytes: a talker from now on."""
        if conn in self._heard or conn not in self._peer:
            return
        self._heard.add(conn)
        peer = self._peer[conn]
        idle = self._idle.get(peer)
        if idle is not None and conn in idle[_SILENT]:
            del idle[_SILENT][conn]
            idle[_TALKER][conn] = None

    def idle(self, conn: Hashable) -> None:
        """No request in progress on ``conn``: it may be closed to make room (unless authenticated)."""
        peer = self._peer.get(conn)
        if peer is None or conn in self._trusted or not self.fair:
            return
        idle = self._idle.get(peer)
        if idle is None:
            idle = self._idle[peer] = (OrderedDict(), OrderedDict())
        idle[_TALKER if conn in self._heard else _SILENT][conn] = None

    def doomed(self, conn: Hashable) -> None:
        """``conn`` is only waiting to close (its request was refused): the first to go, before any
        silent one, even while the client still sends (it is never read)."""
        if conn in self._trusted or not self.fair or conn not in self._peer:
            return
        self.idle(conn)
        idle = self._idle[self._peer[conn]]
        idle[_TALKER].pop(conn, None)
        idle[_SILENT][conn] = None
        idle[_SILENT].move_to_end(conn, last=False)

    def busy(self, conn: Hashable) -> None:
        """A request began on ``conn``."""
        self._unidle(conn, self._peer.get(conn))

    def trust(self, conn: Hashable) -> None:
        """``conn`` sent an authenticated request: out of its peer's share, never closed to make room."""
        peer = self._peer.get(conn)
        if peer is None or conn in self._trusted:
            return
        self._unidle(conn, peer)
        self._trusted.add(conn)
        self._uncount(peer)

    def release(self, conn: Hashable) -> None:
        """``conn`` is gone (or being closed): its slot is free (idempotent)."""
        peer = self._peer.pop(conn, None)
        if peer is None:
            return
        self.total -= 1
        self._unidle(conn, peer)
        self._heard.discard(conn)
        if conn in self._trusted:
            self._trusted.discard(conn)
        else:
            self._uncount(peer)

    def held(self, peer: str) -> int:
        """Unauthenticated connections ``peer`` holds."""
        return self._unauth.get(peer, 0)

    def _uncount(self, peer: str) -> None:
        left = self._unauth[peer] - 1
        if left:
            self._unauth[peer] = left
        else:
            del self._unauth[peer]

    def _unidle(self, conn: Hashable, peer: str | None) -> None:
        idle = self._idle.get(peer) if peer is not None else None
        if idle is None:
            return
        for group in idle:
            group.pop(conn, None)
        if not idle[_SILENT] and not idle[_TALKER]:
            del self._idle[peer]  # type: ignore[arg-type]

    def _first_idle(self, peer: str) -> Hashable | None:
        """The idle connection of ``peer`` to close first: the oldest silent one, else the oldest talker."""
        idle = self._idle.get(peer)
        if idle is None:
            return None
        group = idle[_SILENT] or idle[_TALKER]
        return next(iter(group)) if group else None
