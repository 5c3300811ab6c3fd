"""The router's lean HTTP client (supervisor/router/upstream.py) against raw-socket servers: a stream that
stalls mid-body times out, one cut mid-body is an error, and neither connection is reused."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from supervisor.router.upstream import Client, RemoteProtocolError, UpstreamTimeout

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNK = b"6\r\ndata: \r\n"


async def serve_then(after_first_chunk: str) -> tuple[asyncio.Server, str]:
    """A server answering every request with a head and one chunk, then stalling or closing."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD + CHUNK)
        if after_first_chunk == "close":
            writer.close()
        else:
            await asyncio.sleep(5)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("after,error", [("stall", UpstreamTimeout), ("close", RemoteProtocolError)])
def test_a_stream_that_stalls_or_is_cut_mid_body_fails_and_is_not_pooled(after, error):
    async def go():
        server, url = await serve_then(after)
        client = Client(timeout_s=0.3)
        resp = await client.request("GET", url, b"/", [], b"")
        pieces = resp.stream()
        assert await pieces.__anext__() == b"data: "
        with pytest.raises(error):
            await pieces.__anext__()
        assert not any(o.idle for o in client._origins.values())  # dropped, never reused
        server.close()
    asyncio.run(go())


def test_chunks_are_taken_whole_and_malformed_ones_refused():
    from supervisor.router.upstream import take_chunks
    body = b"6\r\ndata: \r\n3;ext=1\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n"
    assert take_chunks(body) == ([b"data: ", b"abc"], len(body), True)
    for cut in range(len(body)):  # any prefix: the whole chunks in it, never a partial one
        chunks, used, ended = take_chunks(body[:cut])
        assert b"".join(chunks) == b"data: abc"[:len(b"".join(chunks))] and not ended and used <= cut
    assert take_chunks(b"0\r\n\r\n") == ([], 5, True)
    for bad in (b"zz\r\nab\r\n", b"2\r\nabXY", b"-1\r\n"):
        with pytest.raises(ValueError):
            take_chunks(bad)


def test_a_slow_stream_within_the_timeout_is_relayed_whole_and_pooled():
    """The read timeout bounds each wait for the upstream, not the stream: a consumer that pauses
    longer than the timeout (0.3 s) between reads, four times, gets the whole stream (each chunk is
    sent only once the previous one was read: no wait for the upstream is ever long). Chunks that
    arrived together come back joined; the connection is reused."""
    async def go():
        read = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD)
            for i in range(4):
                writer.write(b"1\r\n%d\r\n" % i)
                await writer.drain()
                await read.wait()  # the next chunk once the consumer has this one
                read.clear()
            writer.write(b"1\r\na\r\n1\r\nb\r\n0\r\n\r\n")  # two chunks and the end in one write
            await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = Client(timeout_s=0.3)
        resp = await client.request("GET", url, b"/", [], b"")
        pieces = []
        async for piece in resp.stream():
            pieces.append(piece)
            if len(pieces) <= 4:
                await asyncio.sleep(0.4)  # the consumer is slow (longer than the timeout): not the upstream's fault
                read.set()
        assert b"".join(pieces) == b"0123ab" and pieces[-1] == b"ab" and len(pieces) == 5  # the last two joined
        assert any(o.idle for o in client._origins.values())  # read whole: back in the pool
        server.close()
    asyncio.run(go())


def _raw_server() -> tuple[socket.socket, list[socket.socket], str]:
    """A listening socket served by a thread: it accepts each connection and keeps it (``conns``)."""
    listener = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(listener.accept()[0])
            except OSError:  # (closed)
                return
    threading.Thread(target=accept, daemon=True).start()
    return listener, conns, f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_request_sent_now_is_written_before_the_loop_runs_again_on_a_warm_connection():
    """warm() opens one connection and keeps it idle; send_now writes on it at once: its bytes reach
    the server while the loop is blocked (nothing runs between), with no connection of its own.
    With no idle connection there, send_now sends nothing."""
    async def go():
        listener, conns, url = _raw_server()
        client = Client(timeout_s=2.0)
        assert client.send_now("POST", url, b"/x", [], b"body") is None  # nothing kept warm yet
        client.warm(url)
        client.warm(url)  # (one at a time)
        for _ in range(200):
            await asyncio.sleep(0.005)
            if client._origins[url].idle:
                break
        client.warm(url)  # a fresh one idle: nothing more opened
        await asyncio.sleep(0.05)
        assert len(conns) == 1 and len(client._origins[url].idle) == 1
        sent = client.send_now("POST", url, b"/x", [], b"body")
        assert sent is not None and not client._origins[url].idle
        conns[0].settimeout(2.0)
        got = b""
        while not got.endswith(b"body"):  # (the loop is not run meanwhile: written by send_now itself)
            got += conns[0].recv(4096)
        assert got.startswith(b"POST /x HTTP/1.1\r\n")
        conns[0].sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        resp = await client.response(sent)
        assert resp.status == 200 and await resp.read() == b"ok" and len(conns) == 1
        assert client.send_now("POST", url, b"/x", [], b"again") is not None  # (pooled again after it)
        listener.close()
        await client.aclose()
    asyncio.run(go())


def test_a_request_sent_now_and_abandoned_frees_its_slot_and_closes_its_connection():
    async def go():
        listener, conns, url = _raw_server()
        client = Client(timeout_s=2.0, max_connections=1)
        client.warm(url)
        for _ in range(200):
            await asyncio.sleep(0.005)
            if client._origins[url].idle:
                break
        sent = client.send_now("GET", url, b"/", [], b"")
        assert sent is not None and client.send_now("GET", url, b"/", [], b"") is None  # (the one slot taken)
        client.abandon(sent)
        assert sent.conn.writer.transport.is_closing()
        client.warm(url)
        for _ in range(200):
            await asyncio.sleep(0.005)
            if client._origins[url].idle:
                break
        assert client.send_now("GET", url, b"/", [], b"") is not None  # the slot was given back
        listener.close()
        await client.aclose()
    asyncio.run(go())


def test_connection_slots_go_in_the_order_asked_and_a_leaver_passes_its_slot_on():
    from supervisor.router.slots import Slots

    async def go():
        slots = Slots(1)
        assert slots.take_now() and not slots.take_now()
        order: list[str] = []

        async def taker(name: str) -> None:
            await slots.take()
            order.append(name)
        first, second = asyncio.ensure_future(taker("a")), asyncio.ensure_future(taker("b"))
        await asyncio.sleep(0)
        assert not slots.take_now()  # (others wait: no cutting in)
        slots.release()  # handed to "a"
        first.cancel()  # ... which leaves before it runs: "b" gets it
        await asyncio.sleep(0.01)
        assert order == ["b"] and second.done()
        slots.release()
        assert slots.take_now()
    asyncio.run(go())
