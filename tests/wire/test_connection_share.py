"""Connection fairness (issue 23): 200 sockets that reconnect whenever closed must not lock anyone
out. The bookkeeping (wire/connection_share.py) as a table of moves, then the guarded listener
(wire/guarded_http.py) against real hogs: from another address than everyone else (the data
port), and from the same address with a bearer gate (the admin API on loopback, where every client
is 127.0.0.1). Each case ends with normal requests served."""
from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from wire.connection_share import Occupancy
from wire.guarded_http import Gate, ListenerLimits, peer_of_address
from guarded_listener_helpers import serve_guarded


# ---- the bookkeeping ------------------------------------------------------------------------------
def test_a_peer_at_its_share_closes_its_own_idle_connection_silent_ones_first() -> None:
    occ = Occupancy(cap=8, peer_share=0.5)  # 4 per peer
    for c in ("h1", "h2", "h3"):
        assert occ.admit(c, "hog") == (True, None)
    assert occ.admit("t", "hog", talking=True) == (True, None)  # sent its request at once
    assert occ.admit("h4", "hog") == (True, "h1")  # the oldest silent one goes
    occ.heard("h2")  # h2 spoke: a talker now, after the silent ones
    assert occ.admit("h5", "hog") == (True, "h3")
    assert occ.admit("h6", "hog") == (True, "h4")
    assert occ.admit("h7", "hog") == (True, "h5")
    assert occ.admit("h8", "hog") == (True, "h6")  # still silent ones before the talkers h2, t
    assert occ.held("hog") == 4 and occ.total == 4


def test_busy_connections_are_never_closed_and_a_peer_with_none_idle_is_refused() -> None:
    occ = Occupancy(cap=4, peer_share=0.5)
    for c in ("a", "b"):
        occ.admit(c, "x")
        occ.busy(c)
    assert occ.admit("c", "x") == (False, None)
    occ.idle("b")  # its response went out: idle between keep-alive requests
    assert occ.admit("c", "x") == (True, "b")
    occ.release("a")
    occ.release("a")  # idempotent
    assert occ.held("x") == 1 and occ.total == 1


def test_a_full_listener_closes_an_idle_connection_of_the_biggest_holder() -> None:
    occ = Occupancy(cap=6, peer_share=0.5)  # 3 per peer
    for c, peer in (("b1", "big"), ("b2", "big"), ("b3", "big"), ("s1", "small"), ("s2", "small"), ("o1", "one")):
        occ.admit(c, peer)
    assert occ.admit("n1", "new") == (True, "b1")  # full: big holds the most
    for c in ("b2", "b3", "s1", "s2", "o1"):
        occ.busy(c)
    assert occ.admit("n2", "newer") == (True, "n1")  # the only idle one left
    occ.busy("n2")
    assert occ.admit("n3", "newest") == (False, None)  # full, nothing idle: refused
    assert occ.total == 6


def test_a_full_listener_never_closes_a_smaller_peers_connection_for_a_bigger_one() -> None:
    occ = Occupancy(cap=6, peer_share=0.5)  # 3 per peer
    for c, peer in (("p1", "p"), ("p2", "p"), ("s1", "s"), ("q1", "q"), ("q2", "q"), ("q3", "q")):
        occ.admit(c, peer)
    for c in ("p1", "p2", "q1", "q2", "q3"):
        occ.busy(c)
    assert occ.admit("p3", "p") == (False, None)  # s's only (idle) connection stays: p holds more
    assert occ.admit("n1", "new") == (True, "s1")  # (s and a newcomer: s holds more, its idle one goes)


def test_an_ipv4_client_of_a_dual_stack_listener_is_its_ipv4_address() -> None:
    assert peer_of_address("::ffff:1.2.3.4") == "1.2.3.4" != peer_of_address("::ffff:9.9.9.9")
    assert peer_of_address("2001:db8::1:2") == peer_of_address("2001:db8::ffff:1") == "2001:db8::"  # one /64
    assert peer_of_address("fe80::1%eth0") == "fe80::" and peer_of_address("10.0.0.1") == "10.0.0.1"


def test_authenticated_connections_leave_their_peers_share_and_are_never_closed() -> None:
    occ = Occupancy(cap=4, peer_share=0.5)
    occ.admit("cli", "lo", talking=True)
    occ.busy("cli")
    occ.trust("cli")
    occ.idle("cli")  # between its requests: still not to be closed
    occ.admit("h1", "lo")
    occ.admit("h2", "lo")
    assert occ.held("lo") == 2 and occ.total == 3
    assert occ.admit("h3", "lo") == (True, "h1")
    assert occ.admit("h4", "lo") == (True, "h2")
    occ.admit("o1", "other")
    for c in ("h3", "h4", "o1"):
        occ.busy(c)
    assert occ.admit("x", "lo") == (False, None)  # only the trusted one is idle: never closed


def test_a_refused_connection_waiting_to_close_goes_first() -> None:
    occ = Occupancy(cap=4, peer_share=0.5)
    occ.admit("silent", "lo")
    occ.admit("refused", "lo", talking=True)
    occ.busy("refused")  # its head arrived: a request without the token
    occ.doomed("refused")  # 401 sent; the rest of its body is dropped until it closes
    assert occ.admit("new", "lo") == (True, "refused")  # before the older silent one
    assert occ.admit("cli", "lo", talking=True) == (True, "silent")
    occ.busy("cli")
    occ.trust("cli")
    occ.doomed("cli")  # an authenticated connection stays out of reach
    assert occ.admit("x", "lo") == (True, None)  # the trusted one left the share: room for one more
    assert occ.admit("y", "lo") == (True, "new") and occ.admit("z", "lo") == (True, "x")  # never "cli"
    assert occ.total == 3 and occ.held("lo") == 2


def test_without_a_share_it_is_a_plain_cap() -> None:
    occ = Occupancy(cap=2, peer_share=None)
    assert occ.admit("a", "") == (True, None) and occ.admit("b", "") == (True, None)
    assert occ.admit("c", "") == (False, None)
    occ.release("a")
    assert occ.admit("c", "") == (True, None)


# ---- real listeners and hogs ----------------------------------------------------------------------
class Hog:
    """`count` sockets from `source` to `port` that reconnect whenever the server closes them."""

    def __init__(self, port: int, count: int, source: str = "127.0.0.1") -> None:
        self.port, self.count, self.source = port, count, source
        self.reconnects = 0
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Hog":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for key in list(self._sel.get_map().values()):  # (its sockets end with it, not with the next test)
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()

    def wait_reconnects(self, n: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while self.reconnects < n:
            assert time.monotonic() < deadline, f"the hog reconnected only {self.reconnects} times"
            time.sleep(0.01)

    def _connect(self) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.bind((self.source, 0))
        s.connect_ex(("127.0.0.1", self.port))
        self._sel.register(s, selectors.EVENT_READ)

    def _run(self) -> None:
        for _ in range(self.count):
            self._connect()
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                s = key.fileobj
                try:
                    data = s.recv(1)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    self._sel.unregister(s)
                    s.close()  # type: ignore[union-attr]
                    self._connect()
                    self.reconnects += 1
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


HANGING = [0]  # requests to /hang in progress


async def hello(scope, receive, send) -> None:  # noqa: ANN001
    """200 "ok"; GET /hang answers nothing until the client leaves (a busy connection)."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/hang":
        HANGING[0] += 1
        while (await receive())["type"] != "http.disconnect":
            pass
        HANGING[0] -= 1
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serve(limits: ListenerLimits, gate: Gate | None = None) -> Iterator[tuple[int, object]]:
    """A guarded listener of `hello` on a port of its own: (port, its ConnectionStats)."""
    yield from serve_guarded(hello, limits, gate, backlog=2048)


def until(cond, what: str, timeout_s: float = 30) -> None:  # noqa: ANN001
    """Wait for ``cond()`` (an event of the listener), failing after ``timeout_s`` with ``what``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def holders(source: str, port: int, count: int, head: bytes) -> list[socket.socket]:
    """``count`` connections from ``source`` that each send ``head`` and then neither read nor close."""
    out = []
    for _ in range(count):
        s = socket.socket()
        s.bind((source, 0))
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(head)
        except OSError:  # refused (reset) at once
            s.close()
            continue
        out.append(s)
    return out


def request_from(source: str, port: int, headers: bytes = b"") -> bytes:
    """One request on a new connection from `source`; the response (until the server closes or it is whole)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n%sconnection: close\r\n\r\n" % headers)
        out = b""
        while data := s.recv(65536):
            out += data
        return out


@pytest.fixture()
def data_port() -> Iterator[tuple[int, object]]:
    yield from serve(ListenerLimits(max_connections=20, peer_share=0.5, header_timeout_s=30))


def test_a_hog_from_one_address_keeps_to_its_share_and_others_are_served(data_port) -> None:  # noqa: ANN001
    port, stats = data_port
    with Hog(port, 200, source="127.0.0.2") as hog:
        hog.wait_reconnects(400)  # 200 sockets on a share of 10: it cycles through its own
        answers = [request_from("127.0.0.3", port) for _ in range(15)]
        assert stats.occupancy.held("127.0.0.2") <= 10  # type: ignore[attr-defined]
    assert all(a.startswith(b"HTTP/1.1 200 ") and a.endswith(b"ok") for a in answers), answers
    assert stats.evicted > 0  # type: ignore[attr-defined]
    assert request_from("127.0.0.2", port).endswith(b"ok")


def test_a_peer_whose_connections_are_all_busy_keeps_to_its_share(data_port) -> None:  # noqa: ANN001
    """Requests that never end hold their connections (nothing to close to make room): the peer is
    refused past its share, and another client is still served."""
    port, stats = data_port
    busy = holders("127.0.0.4", port, 40, b"GET /hang HTTP/1.1\r\nhost: t\r\n\r\n")
    try:
        until(lambda: HANGING[0] == 10 and stats.refused + stats.evicted == 30,  # type: ignore[attr-defined]
              f"{HANGING[0]} requests hang, {stats.refused} refused, {stats.evicted} closed")  # type: ignore[attr-defined]
        answers = [request_from("127.0.0.3", port) for _ in range(15)]
        refused = stats.refused  # type: ignore[attr-defined]
        with pytest.raises(ConnectionResetError):
            request_from("127.0.0.4", port)
        assert stats.refused == refused + 1 and stats.occupancy.held("127.0.0.4") == 10  # type: ignore[attr-defined]
    finally:
        for s in busy:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 200 ") and a.endswith(b"ok") for a in answers), answers
    until(lambda: HANGING[0] == 0, "the hanging requests did not see their clients leave")


TOKEN = b"Bearer sesame"


def gate() -> Gate:
    def check(path: bytes, headers: list[tuple[bytes, bytes]]) -> bool | None:
        if (b"authorization", TOKEN) in headers:
            return True
        return None if path == b"/open" else False
    body = b'{"error": "no"}'
    return Gate(check, b"HTTP/1.1 401 Unauthorized\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body))


@pytest.fixture()
def admin_port() -> Iterator[tuple[int, object]]:
    yield from serve(ListenerLimits(max_connections=16, peer_share=0.5, header_timeout_s=30), gate())


def test_a_hog_on_the_same_address_never_locks_out_an_authenticated_client(admin_port) -> None:  # noqa: ANN001
    """Every client of a loopback admin API is 127.0.0.1, the hog included: a client's connection
    that carries its request (and the token) is never the one closed to make room."""
    port, stats = admin_port
    with Hog(port, 200) as hog:
        hog.wait_reconnects(400)
        answers = [request_from("127.0.0.1", port, b"authorization: " + TOKEN + b"\r\n") for _ in range(30)]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"authorization": TOKEN.decode()}) as c:
            kept = [c.get("/x").status_code for _ in range(10)]  # one keep-alive connection, trusted
        refused = request_from("127.0.0.1", port)
    assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers), [a[:40] for a in answers]
    assert kept == [200] * 10
    assert refused.startswith(b"HTTP/1.1 401 ") and stats.unauthorized >= 1  # type: ignore[attr-defined]
    assert stats.evicted > 0  # type: ignore[attr-defined]
    assert request_from("127.0.0.1", port, b"authorization: " + TOKEN + b"\r\n").endswith(b"ok")


def test_refused_requests_held_open_from_many_addresses_never_lock_out_an_authenticated_client(admin_port) -> None:  # noqa: ANN001, E501
    """A local process may send from any 127/8 address: two hogs of 100 connections that each send a
    request without the token and then hold the connection (never read, never close) fill the cap
    with refused connections. Those are the first to close: authenticated requests still get in."""
    port, stats = admin_port
    head = b"GET /status HTTP/1.1\r\nhost: t\r\n\r\n"
    held = holders("127.0.0.1", port, 100, head) + holders("127.0.0.2", port, 100, head)
    try:
        until(lambda: stats.occupancy.total == 16 and stats.unauthorized >= 16,  # type: ignore[attr-defined]
              "the hogs did not fill the cap with refused requests")
        answers = [request_from(src, port, b"authorization: " + TOKEN + b"\r\n")
                   for src in ("127.0.0.1", "127.0.0.2", "127.0.0.3") for _ in range(5)]
    finally:
        for s in held:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers), [a[:40] for a in answers]
    assert stats.refused == 0 and stats.evicted >= 15  # type: ignore[attr-defined]


def send_unauthenticated_body(port: int, size: int) -> tuple[bytes, int, bool]:
    """POST ``size`` bytes to /admin/promote without the token, sending on after the answer and its
    end as a client that ignores them would: (what came back, bytes sent, reset by the server)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /admin/promote HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % size)
    got, sent, chunk, reset = b"", 0, b"x" * 65536, False
    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
    try:
        while sent < size:
            events = sel.select(10)
            assert events, "neither an answer nor room to send within 10 s"
            _, mask = events[0]
            if mask & selectors.EVENT_READ:
                data = s.recv(65536)
                if data:
                    got += data
                else:  # the server's end of the answer: keep sending anyway
                    sel.modify(s, selectors.EVENT_WRITE)
            elif mask & selectors.EVENT_WRITE:
                sent += s.send(chunk)
    except (BrokenPipeError, ConnectionResetError):
        reset = True
    finally:
        s.close()
    return got, sent, reset


def test_an_unauthenticated_body_is_never_read_before_the_401(admin_port) -> None:  # noqa: ANN001
    """500 MB announced, streamed on until the server closes: the 401 comes from the head alone, and
    the server drops at most REFUSED_BODY_DISCARD bytes (plus socket buffers) before closing."""
    port, stats = admin_port
    got, sent, reset = send_unauthenticated_body(port, 500_000_000)
    assert got.startswith(b"HTTP/1.1 401 ") and got.endswith(b'{"error": "no"}'), got[:200]
    assert reset and sent < 32 << 20, f"{sent} bytes sent before the server closed"
    assert stats.unauthorized == 1  # type: ignore[attr-defined]
    assert request_from("127.0.0.1", port, b"authorization: " + TOKEN + b"\r\n").endswith(b"ok")
    assert request_from("127.0.0.1", port).startswith(b"HTTP/1.1 401 ")
