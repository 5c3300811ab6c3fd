"""The admin event stream (supervisor/admin/event_stream.py): bounded history, resume by Last-Event-ID, events from
the supervisor's real EventBus (zmq PUB over ipc) to every client, a client that falls behind dropped,
one that stops reading cut after the write timeout (real uvicorn, real sockets), a limit on clients."""
from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import zmq
from fastapi import FastAPI, Request

from supervisor.admin.event_stream import _DROPPED, EventFanout, TooManyClients
from supervisor.effects.bus import EventBus
from supervisor.effects.servers import bind_tcp, make_server


def test_history_is_bounded_and_a_resume_gets_only_what_it_missed():
    f = EventFanout(lambda: "ipc:///nonexistent", history=5)
    for i in range(8):
        f.deliver({"type": "t", "i": i})
    assert [n for n, _ in f.backlog(None)] == [4, 5, 6, 7, 8]
    assert [ev["i"] for _, ev in f.backlog(f"{f.boot}:6")] == [6, 7]
    assert len(f.backlog("0000beef:6")) == 5  # another boot of the supervisor: everything it has
    assert len(f.backlog("garbage")) == 5
    assert f.format(3, {"a": 1}) == f"id: {f.boot}:3\ndata: {{\"a\":1}}\n\n".encode()


def test_clients_are_limited():
    f = EventFanout(lambda: "ipc:///nonexistent", max_clients=2)
    subs = [f.subscribe(), f.subscribe()]
    with pytest.raises(TooManyClients, match="2 event streams are open"):
        f.subscribe()
    f.unsubscribe(subs[0])
    f.subscribe()


def test_bus_events_reach_every_client_and_one_that_falls_behind_is_dropped(tmp_path):
    async def main() -> None:
        ctx = zmq.Context()
        bus = EventBus(ctx, str(tmp_path / "events.sock"))
        f = EventFanout(lambda: bus.endpoint, queue_size=4)
        await f.start()
        try:
            reader, idle = f.subscribe(), f.subscribe()
            deadline = time.monotonic() + 10
            while reader.queue.empty():  # slow joiner: probe until the subscription is live
                assert time.monotonic() < deadline, "no event came through the PUB"
                bus.publish({"type": "probe"})
                await asyncio.sleep(0.02)
            while not reader.queue.empty():
                reader.queue.get_nowait()
            got = []
            for i in range(10):
                bus.publish({"type": "transition", "i": i})
                got.append(await asyncio.wait_for(reader.queue.get(), 5))
            assert [ev["i"] for _, ev in got] == list(range(10))
            assert f.subscribers == {reader}  # the idle one filled its 4 places and was dropped
            assert idle.dropped and idle.queue.qsize() == 1 and idle.queue.get_nowait() is _DROPPED
            assert len(f.history) <= 500
        finally:
            await f.close()
            bus.close()
            ctx.term()
    asyncio.run(main())


def _app(f: EventFanout) -> FastAPI:
    app = FastAPI()

    @app.get("/events")
    async def events(request: Request):
        return f.stream(request.headers.get("last-event-id"))
    return app


async def _serve(f: EventFanout):
    sock = bind_tcp("127.0.0.1", 0, "test")
    server = make_server(_app(f), sock, "critical")
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_over_http_a_client_that_stops_reading_is_cut_and_others_go_on():
    async def main() -> None:
        f = EventFanout(lambda: "unused", queue_size=4, write_timeout_s=0.5, keepalive_s=0.2)
        server, task, url = await _serve(f)
        try:
            f.deliver({"type": "before"})
            async with httpx.AsyncClient(timeout=5) as c:
                # a well-behaved client: hello, the history, live events, keepalives
                async with c.stream("GET", url + "/events") as r:
                    assert r.headers["content-type"].startswith("text/event-stream") and "content-length" not in r.headers
                    lines = r.aiter_lines()
                    assert await anext(lines) == "retry: 1000"
                    assert await anext(lines) == "event: hello"
                    assert (await anext(lines)).startswith('data: {"boot": "' + f.boot)
                    seen = []
                    f.deliver({"type": "live"})
                    async for line in lines:
                        seen.append(line)
                        if line.startswith(": keepalive"):
                            break
                    assert f'id: {f.boot}:1' in seen and 'data: {"type":"before"}' in seen
                    assert 'data: {"type":"live"}' in seen
                    last = [x for x in seen if x.startswith("id: ")][-1][4:]
                # the client left: forgotten
                await _until(lambda: not f.subscribers, "the closed client is unsubscribed")
                # a resume from the last id gets only what came after
                f.deliver({"type": "missed"})
                async with c.stream("GET", url + "/events", headers={"last-event-id": last}) as r:
                    lines = r.aiter_lines()
                    got = [await anext(lines) for _ in range(6)]
                    assert got[2] == 'data: {"boot": "%s", "backlog": 1}' % f.boot
                    assert got[5] == 'data: {"type":"missed"}'
            # a client that never reads: big events fill the socket buffers, then its queue
            await _until(lambda: not f.subscribers, "the resumed client is unsubscribed")
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            raw.sendall(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
            await _until(lambda: len(f.subscribers) == 1, "the raw client subscribed")
            sub = next(iter(f.subscribers))
            blob = "x" * (256 << 10)
            for i in range(40):
                f.deliver({"type": "big", "i": i, "blob": blob})
                await asyncio.sleep(0.01)
            await _until(lambda: not f.subscribers, "the stuck client is dropped", timeout=5)
            assert sub.dropped and sub.queue.qsize() <= 4  # bounded while it was stuck
            await asyncio.sleep(1.0)  # > write_timeout_s, still not reading: the server gives up on it
            # its connection is closed by the server (we read what was buffered, then EOF)
            raw.setblocking(False)
            closed, data = False, b""
            for _ in range(1000):
                try:
                    chunk = raw.recv(1 << 20)
                    if chunk == b"":
                        closed = True
                        break
                    data += chunk
                except BlockingIOError:
                    await asyncio.sleep(0.01)
                except ConnectionResetError:
                    closed = True
                    break
            raw.close()
            assert closed, "the server kept the stuck connection open"
            assert data.startswith(b"HTTP/1.1 200") and b"event: overflow" not in data and len(data) < 40 * len(blob)
            # and the stream still serves new clients
            async with httpx.AsyncClient(timeout=5) as c:
                async with c.stream("GET", url + "/events") as r:
                    assert r.status_code == 200
        finally:
            server.should_exit = True
            await task
    asyncio.run(main())


def test_streams_end_when_the_supervisor_stops():
    async def main() -> None:
        state = {"stopping": False}
        f = EventFanout(lambda: "unused", stopping=lambda: state["stopping"])
        server, task, url = await _serve(f)
        try:
            async with httpx.AsyncClient(timeout=5) as c:
                async with c.stream("GET", url + "/events") as r:
                    lines = r.aiter_lines()
                    assert await anext(lines) == "retry: 1000"
                    await _until(lambda: len(f.subscribers) == 1, "subscribed")
                    state["stopping"] = True
                    rest = [line async for line in lines]  # ends: the server closed the stream (no keepalives)
                    assert "event: bye" in rest and not f.subscribers
        finally:
            server.should_exit = True
            await task
    asyncio.run(main())


async def _until(pred, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.01)
