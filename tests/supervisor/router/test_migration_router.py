"""The router's continuation rules against stand-in engines that die on cue (real processes, real
sockets): each speaks the engine's stream format with token ids (and its scheduled marker, the
`: scheduled` comment, as it begins running a request), generates token i as text "t{i} ",
continues from `continuation.output_token_ids`, and exits (os._exit) after `die_after` chunks of a
request: a poison request (die_after 0: it dies having begun running the request, before any
token) or an engine lost mid-stream; or, with `queued_s`, it answers the request's head, keeps it
queued (no marker) and dies that much later (another request killed it); with `wait_s`, it keeps it
queued that long, sending nothing, then runs it (behind others that ran meanwhile). The real engine and
supervisor are in tests/supervisor/router/test_migration_failover.py and
tests/supervisor/router/test_migration_second_death.py."""
from __future__ import annotations

import asyncio
import contextlib
import json
import textwrap
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from supervisor.config import MigrationSection
from supervisor.effects.servers import bind_tcp, make_server
from supervisor.metrics import Metrics
from supervisor.router import build_router, migrating
from supervisor.router.routing import RoutingTable, Upstream
from tests.supervisor.router.test_supervisor_router import start_upstream

ENGINE = textwrap.dedent('''
    import asyncio, json, os, sys, time
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    import uvicorn
    from wire.batch_wire import read_members
    app = FastAPI()
    seen, peers, tails, arrived_at, aborts = [], [], [], [], []

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrived_at.append(time.monotonic())  # (the host's clock: the tests compare it with their own)
        body = json.loads(await request.body())
        seen.append(body)
        peers.append(request.client.port)
        return StreamingResponse(answer(body, request), media_type="text/event-stream")

    @app.post("/v1/continuations")  # the router's batch: the members' streams, framed (engines/frontend/continuation_batch.py)
    async def continuations(request: Request):
        arrived_at.append(time.monotonic())
        members = [{"body": json.loads(m.json), "ids": m} for m in read_members(await request.body())]
        for m in members:  # (a continuation's ids are framed raw: seen as its own request would carry them)
            if m["ids"].prompt_ids is not None:
                m["body"]["continuation"] = {"prompt_token_ids": m["ids"].prompt_ids.tolist(),
                                             "output_token_ids": m["ids"].output_ids.tolist()}
        seen.extend(m["body"] for m in members)
        peers.append(request.client.port)
        async def framed():  # members in turn, each frame out before its stream goes on (it may die next)
            streams = [(i, answer(m["body"], request)) for i, m in enumerate(members)]
            while streams:
                for entry in list(streams):
                    i, events = entry
                    try:
                        data = (await events.__anext__()).encode()
                    except StopAsyncIteration:
                        streams.remove(entry)
                        yield b"%d 0 0\\n" % i
                        continue
                    yield b"%d 200 %d\\n" % (i, len(data)) + data
        return StreamingResponse(framed(), media_type="application/x-understudy-frames",
                                 headers={"x-understudy-batch": "b1"})

    def answer(body, request):
        cont = body.get("continuation") or {}
        start = len(cont.get("output_token_ids", []))
        die_after = body.get("die_after", {}).get(sys.argv[2])
        queued_s = body.get("queued_s", {}).get(sys.argv[2])
        wait_s = body.get("wait_s", {}).get(sys.argv[2])
        async def gen():
            if queued_s is not None:  # never scheduled: no marker, no token
                yield ": keep-alive\\n\\n"
                await asyncio.sleep(queued_s)
                os._exit(1)
            if wait_s is not None:  # scheduled that late: no byte until then
                await asyncio.sleep(wait_s)
            yield ": scheduled\\n\\n"
            sent = 0
            for i in range(start, body["max_tokens"]):
                if die_after is not None and sent >= die_after:
                    os._exit(1)
                choice = {"index": 0, "text": f"t{i} ", "finish_reason": "length" if i == body["max_tokens"] - 1
                          else None, "token_ids": [i]}
                if not cont and i == 0:
                    choice["prompt_token_ids"] = [7, 8]
                yield "data: " + json.dumps({"id": "cmpl-x", "created": 1, "model": "m", "object": "text_completion",
                                             "choices": [choice]}) + "\\n\\n"
                sent += 1
                await asyncio.sleep(0.01)
            yield "data: [DONE]\\n\\n"
            if "tail_s" in body:  # the chunked body's end comes this much later: did the router wait for it?
                try:
                    await asyncio.sleep(body["tail_s"])
                    tails.append("left" if await request.is_disconnected() else "waited")
                except asyncio.CancelledError:  # (the server cancels a stream whose client left)
                    tails.append("left")
                    raise
        return gen()

    @app.post("/v1/continuations/abort")  # one member of a batch stopped (its client left)
    async def abort(request: Request):
        aborts.append(json.loads(await request.body())["index"])
        return {"aborted": True}

    @app.get("/aborts")
    async def get_aborts():
        return aborts

    @app.get("/seen")
    async def get_seen():
        return seen

    @app.get("/peers")
    async def get_peers():  # the port each request came from: which connection the router used
        return peers

    @app.get("/arrived_at")
    async def get_arrived_at():  # when each request's head came (time.monotonic)
        return arrived_at

    @app.get("/tails")
    async def get_tails():  # for each stream with a tail: whether the router left before its end
        return tails

    @app.get("/health")
    async def health():
        return {}

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
''')


BATCH = True  # router.migration.batch of the routers these tests build (both ways: `batched`)


@pytest.fixture(autouse=True, params=[True, False], ids=["batched", "one-each"])
def batched(request, monkeypatch):
    """Every rule holds with a failover's continuations batched (the default) and sent one each."""
    monkeypatch.setattr(f"{__name__}.BATCH", request.param)


def stand_in_engines(tmp_path, monkeypatch, n: int):
    """Stand-in engines u1..un (a fresh set per test: they die), killed after it."""
    import tests.supervisor.router.test_supervisor_router as tsr
    monkeypatch.setattr(tsr, "UPSTREAM", ENGINE)
    procs = [start_upstream(tmp_path, f"u{i}") for i in range(1, n + 1)]
    yield procs
    for p, _ in procs:
        p.kill()
        p.wait()


@pytest.fixture()
def engines(tmp_path, monkeypatch):
    """Three stand-in engines u1..u3."""
    yield from stand_in_engines(tmp_path, monkeypatch, 3)


async def follow(table: RoutingTable, engines) -> None:
    """The supervisor's part: when the primary's process exits, promote the next engine."""
    for epoch, (proc, url) in enumerate(engines, start=1):
        table.set_primary(Upstream(url, f"u{epoch}", epoch))
        while proc.poll() is None:
            await asyncio.sleep(0.01)
        table.mark_lost(epoch)
        table.set_primary(None, "failing over")


async def both_lost_at_once(table: RoutingTable, engines) -> None:
    """u1 dies; u2 is promoted and fenced in the same step (both engines died together), before any
    request reached it; u3 comes back later."""
    (p1, url1), (_, url2), (_, url3) = engines
    table.set_primary(Upstream(url1, "u1", 1))
    while p1.poll() is None:
        await asyncio.sleep(0.01)
    table.mark_lost(1)
    table.set_primary(Upstream(url2, "u2", 2))
    table.mark_lost(2)
    await asyncio.sleep(0.3)
    table.set_primary(Upstream(url3, "u3", 3))


def request(engines, body: dict, supervisor=follow, **cfg):
    async def go():
        table, metrics = RoutingTable(), Metrics()
        events: list[dict] = []
        app = build_router(table, metrics, hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=10,
                           migration=MigrationSection(**{"batch": BATCH, **cfg}), publish=events.append)
        watcher = asyncio.ensure_future(supervisor(table, engines))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r", timeout=30) as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "p", **body})
        watcher.cancel()
        return r, events, metrics.render().decode()
    return asyncio.run(go())


def seen(url: str) -> list[dict]:
    return httpx.get(url + "/seen").json()


def test_a_request_that_kills_two_engines_before_any_token_is_quarantined(engines):
    r, events, metrics = request(engines, {"max_tokens": 5, "die_after": {"u1": 0, "u2": 0}})
    assert r.status_code == 502 and "quarantined" in r.json()["error"]["message"], r.text
    assert 'understudy_migrations_total{result="quarantined"} 1.0' in metrics
    assert "understudy_router_first_token_seconds_count 0.0" in metrics  # no token ever came
    assert [e["result"] for e in events] == ["quarantined"]
    assert seen(engines[2][1]) == [], "never sent to a third engine"


def test_an_engine_that_only_queued_the_request_does_not_count_towards_quarantine(engines):
    """Issue 23: u1 dies having begun the request (no token yet), u2 takes its continuation but only
    queues it (behind others) and dies too: the request did not run on u2, so u3 serves it."""
    r, events, metrics = request(engines, {"max_tokens": 3, "die_after": {"u1": 0}, "queued_s": {"u2": 0.2}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "t0 t1 t2 "
    assert [e["result"] for e in events] == ["continued"]
    assert 'understudy_migrations_total{result="quarantined"} 0.0' in metrics
    assert len(seen(engines[2][1])) == 1


def test_a_request_that_kills_every_engine_it_runs_on_is_stopped_after_two_even_with_queues_between(engines):
    """u1 runs the request and dies before its first token; u2 only queues it and dies; u3 runs it
    and dies before a token: it ran on two engines that failed, with no token in between."""
    r, events, _ = request(engines, {"max_tokens": 3, "die_after": {"u1": 0, "u3": 0}, "queued_s": {"u2": 0.2}})
    assert r.status_code == 502 and "quarantined" in r.json()["error"]["message"], r.text
    assert [e["result"] for e in events] == ["quarantined"]
    assert "2 engines that failed" in r.json()["error"]["message"]  # u1 and u3; not u2, which only queued it


def test_a_primary_fenced_before_the_request_reached_it_does_not_count_towards_quarantine(engines):
    r, events, _ = request(engines, {"max_tokens": 3, "die_after": {"u1": 0}}, supervisor=both_lost_at_once)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "t0 t1 t2 "
    assert [e["result"] for e in events] == ["continued"]
    assert seen(engines[1][1]) == [], "u2 was fenced before the request reached it"


def test_a_request_making_progress_between_failures_keeps_migrating(engines):
    r, events, metrics = request(engines, {"max_tokens": 6, "die_after": {"u1": 2, "u2": 2}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "t0 t1 t2 t3 t4 t5 " and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}
    assert [(e["result"], e["tokens_replayed"]) for e in events] == [("continued", 2), ("continued", 4)]
    third = seen(engines[2][1])[0]
    assert third["continuation"] == {"prompt_token_ids": [7, 8], "output_token_ids": [0, 1, 2, 3]}
    assert "prompt" not in third  # (continuation.prompt_token_ids is its prompt: sent once)
    assert third["stream"] is True and third["return_token_ids"] is True and isinstance(third["seed"], int)
    assert 'understudy_migrations_total{result="continued"} 2.0' in metrics
    assert "understudy_migration_stall_seconds_count 2.0" in metrics
    assert "understudy_router_first_token_seconds_count 1.0" in metrics  # the first attempt's, not the continuations'



def test_the_migration_limit_ends_the_request_explicitly(engines):
    r, events, _ = request(engines, {"max_tokens": 6, "die_after": {"u1": 2, "u2": 2}}, max_migrations=1)
    assert r.status_code == 502 and "max_migrations=1" in r.json()["error"]["message"]
    assert [e["result"] for e in events] == ["continued", "limit"]
    r, events, _ = request(engines[2:], {"max_tokens": 6, "die_after": {"u3": 3}}, max_replay_tokens=4)
    assert r.status_code == 502 and "max_replay_tokens=4" in r.json()["error"]["message"]


def test_a_streaming_client_gets_one_seamless_stream(engines):
    async def go():
        table = RoutingTable()
        app = build_router(table, Metrics(), hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=10)
        watcher = asyncio.ensure_future(follow(table, engines))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r", timeout=30) as c:
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 5, "stream": True,
                                                      "die_after": {"u1": 3}})
        watcher.cancel()
        return r
    r = asyncio.run(go())
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "t0 t1 t2 t3 t4 "
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0] for c in chunks)


@contextlib.asynccontextmanager
async def on_socket(app) -> AsyncIterator[str]:  # noqa: ANN001
    """`app` served by our listener (supervisor/effects/servers.py) on a port of its own: its URL."""
    sock = bind_tcp("127.0.0.1", 0, "router")
    server = make_server(app, sock, "warning")
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving


def stream_until_cut(engines, body: dict, **router_options) -> tuple[list[str], str | None]:  # noqa: ANN001
    """One streaming completion through a router on our listener: its lines, and how the connection
    broke (None if it ended whole)."""
    async def go() -> tuple[list[str], str | None]:
        table = RoutingTable()
        app = build_router(table, Metrics(), hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=10,
                           **router_options)
        watcher = asyncio.ensure_future(follow(table, engines))
        lines, error = [], None
        async with on_socket(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            try:
                async with c.stream("POST", "/v1/completions", json={
                        "model": "m", "prompt": "p", "max_tokens": 5, "stream": True, **body}) as r:
                    async for line in r.aiter_lines():
                        lines.append(line)
            except httpx.RemoteProtocolError as e:
                error = str(e)
        watcher.cancel()
        return lines, error
    return asyncio.run(go())


def test_a_cut_stream_ends_with_its_error_event_and_a_cut_connection_without_a_traceback(engines, capfd):
    """Issue 23: a streaming request quarantined after tokens went out: its client gets the error
    event, then the connection is cut (no end of the chunked body, so it cannot pass for a whole
    answer); the listener logs no ASGI traceback (only the router's one warning)."""
    lines, error = stream_until_cut(engines, {"die_after": {"u1": 1, "u2": 0}})
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert data[0]["choices"][0]["text"] == "t0 " and "quarantined" in data[-1]["error"]["message"], data
    assert error is not None and "incomplete chunked read" in error, error
    err = capfd.readouterr().err  # (uvicorn logs to stderr, through its own logging config)
    assert "Traceback" not in err and "ASGI" not in err, err
    assert seen(engines[2][1]) == []


def test_with_migration_off_a_cut_stream_says_continuation_is_off(engines, capfd):
    """Issue 23: a pass-through stream cut by its engine's death says why it was not continued:
    router.migration.enabled is false (not "only n=1 requests can", which it is)."""
    lines, error = stream_until_cut(engines, {"die_after": {"u1": 2}}, migration=MigrationSection(enabled=False))
    last = json.loads([ln for ln in lines if ln.startswith("data: ")][-1][6:])
    assert "router.migration.enabled is false" in last["error"]["message"], last
    assert error is not None and "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("body", [{"wait_s": {"u1": 1.5}}, {"die_after": {"u1": 0}, "wait_s": {"u2": 1.5}}],
                         ids=["queued", "continuation-queued"])
def test_a_streaming_client_whose_request_waits_for_its_first_token_hears_keep_alives(engines, monkeypatch, body):
    """Issue 52's stream that timed out with nothing received: a request (or its continuation, after its
    primary died) queued behind others waits for its first token longer than its client's read timeout
    (the last of 32 streams at max_num_seqs 2: ~60 s on the CPU test node). Its client hears a comment
    every KEEP_ALIVE_S meanwhile (the 200 head first), and gets the whole answer."""
    monkeypatch.setattr(migrating, "KEEP_ALIVE_S", 0.2)

    async def go() -> tuple[int, bytes]:
        table = RoutingTable()
        app = build_router(table, Metrics(), hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=10,
                           migration=MigrationSection(batch=BATCH))
        watcher = asyncio.ensure_future(follow(table, engines))
        async with on_socket(app) as url, httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(10, read=1)) as c:
            async with c.stream("POST", "/v1/completions", json={
                    "model": "m", "prompt": "p", "max_tokens": 3, "stream": True, **body}) as r:
                raw = b"".join([piece async for piece in r.aiter_bytes()])
        watcher.cancel()
        return r.status_code, raw
    status, raw = asyncio.run(go())
    assert status == 200 and migrating.KEEP_ALIVE in raw, raw
    data = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in data) == "t0 t1 t2 " and raw.endswith(b"data: [DONE]\n\n"), raw


def closed_loop(url: str, n: int, tail_s: float) -> list[float]:
    """A real router on a socket before the engine at `url`; a client sends n streaming requests,
    each the moment it reads the previous one's [DONE]. Returns each request's seconds to [DONE]."""
    async def go() -> list[float]:
        table = RoutingTable()
        table.set_primary(Upstream(url, "u1", 1))
        app = build_router(table, Metrics(), hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=10)
        took = []
        async with on_socket(app) as base:
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                for _ in range(n):
                    t = asyncio.get_running_loop().time()
                    body = {"model": "m", "prompt": "p", "max_tokens": 2, "stream": True, "tail_s": tail_s}
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                break
                    took.append(asyncio.get_running_loop().time() - t)
        return took
    return asyncio.run(go())


def test_a_finished_streams_connection_is_back_in_the_pool_before_its_client_hears_done(engines):
    """Closed-loop clients send their next request as soon as they read [DONE]; the engine's chunked
    body ends just after that event. The next request must find the connection idle: a new
    connection per request costs a connect and an accept in two busy event loops."""
    closed_loop(engines[0][1], 4, tail_s=0.02)  # (well inside STREAM_END_WAIT_S on a loaded machine)
    peers = httpx.get(engines[0][1] + "/peers").json()
    assert len(peers) == 4 and len(set(peers)) == 1, f"one upstream connection expected, got ports {peers}"


def test_an_engine_that_never_ends_its_stream_after_done_costs_only_its_connection(engines):
    """The answer is whole at [DONE]: a stream whose end does not follow is dropped after a short
    wait (migrating.STREAM_END_WAIT_S), not held up to the upstream timeout."""
    closed_loop(engines[0][1], 2, tail_s=5)  # (the upstream timeout is 10 s)
    deadline = time.monotonic() + 30
    while len(tails := httpx.get(engines[0][1] + "/tails").json()) < 2:
        assert time.monotonic() < deadline, tails
        time.sleep(0.05)
    assert tails == ["left", "left"], "the router waited for the end of a body whose answer was whole"
    peers = httpx.get(engines[0][1] + "/peers").json()
    assert len(peers) == 2 and peers[0] != peers[1], "the stalled connection must not be reused"


def test_a_failovers_batch_is_split_to_fit_the_engines_body_limit():
    """Members go together while their bodies fit `limits.max_body_bytes`; one over it goes alone
    (and is refused 413 by the engine, as it would be alone)."""
    from supervisor.router.batching import Batcher, Member

    async def go():
        b = Batcher(None, RoutingTable(), max_bytes=250, timeout_s=1)  # (splitting sends nothing)
        members = [Member(b"x" * n, 1) for n in (100, 100, 60, 500, 10)]
        return [[len(m.frame) for m in batch] for batch in b._split(members)]
    assert asyncio.run(go()) == [[100, 100], [60], [500], [10]]


def test_a_members_scheduled_marker_says_it_ran_as_it_arrives():
    """The batch's reader tells the continuation that its engine began running it the moment the
    marker comes, not when the continuation's task reads it: a loss in between still counts."""
    from wire import sse
    from supervisor.router.batching import Member

    async def go():
        calls = []
        m = Member(b"", 1, ran=lambda: calls.append(1))
        m.take(200, b'data: {"x": 1}\n\n')
        before = len(calls)
        m.take(200, sse.SCHEDULED)
        m.take(200, sse.SCHEDULED)
        late = Member(b"", 1, ran=lambda: calls.append(2))
        late.close()  # (interrupted first: what comes after is not this attempt's)
        late.take(200, sse.SCHEDULED)
        return before, calls
    assert asyncio.run(go()) == (0, [1])


def test_a_member_waiting_longer_than_its_timeout_fails_and_one_fed_in_time_does_not():
    """A batch member's stream is bounded per wait (batching.Member, supervisor/router/idle_guard.py): bytes that keep
    coming within the timeout keep it going past several timeouts in all; a silence of the whole
    timeout ends it with UpstreamTimeout, and stops it in the engine."""
    from supervisor.router.batching import Member
    from supervisor.router.http_wire import UpstreamTimeout

    async def go():
        fed = Member(b"", 0.2)
        fed.take(200, b"data: 0\n\n")

        async def feed():
            for i in range(1, 8):  # 0.7 s in all, every wait 0.1 s
                await asyncio.sleep(0.1)
                fed.take(200, b"data: %d\n\n" % i)
            fed.take(0, b"")
        feeder = asyncio.ensure_future(feed())
        got = [chunk async for chunk in fed.stream()]
        await feeder
        silent = Member(b"", 0.2)
        silent.take(200, b"data: 0\n\n")
        aborted = []
        silent.bind_abort(lambda: aborted.append(True))
        try:
            async for _ in silent.stream():
                pass
        except UpstreamTimeout as e:
            return b"".join(got).count(b"data:"), str(e), aborted
    count, error, aborted = asyncio.run(go())
    assert count == 8 and "within 0.2s" in error and aborted == [True]


def test_a_member_closed_before_its_batch_ran_is_stopped_in_the_engine_once_it_runs():
    """A continuation whose request ended (its client left) before its batch's answer came is
    aborted in the engine as the batch starts running there, not left to run to its end."""
    from supervisor.router.batching import Member

    async def go():
        aborted = []
        early = Member(b"", 1)
        early.close()
        early.bind_abort(lambda: aborted.append("early"))
        done = Member(b"", 1)
        done.take(0, b"")  # (the engine ended it: nothing to stop)
        done.close()
        done.bind_abort(lambda: aborted.append("done"))
        return aborted
    assert asyncio.run(go()) == ["early"]


@pytest.mark.parametrize("fenced", [False, True], ids=["client-left", "fenced"])
def test_a_fenced_batchs_members_send_its_engine_no_aborts(engines, fenced):
    """A member closed unfinished (its client left) is aborted in the engine, alone; once its batch's
    primary is fenced, its members' ends send none (the fence ends the batch's call, and with its
    connection every member): a member's task may run before the batch's, as at a real fence."""
    from array import array

    from wire.batch_wire import encode_member
    from supervisor.router.batching import Batcher
    from supervisor.router.upstream import Client

    async def go() -> list[int]:
        table, url = RoutingTable(), engines[0][1]
        batcher = Batcher(Client(timeout_s=10), table, max_bytes=1 << 20, timeout_s=10)
        up = Upstream(url, "u1", 1)
        table.set_primary(up)
        body = json.dumps({"model": "m", "prompt": "p", "max_tokens": 500, "stream": True}).encode()
        frame = encode_member(b"/v1/completions", body, array("q", [7, 8]), array("q", [0]))
        members = await asyncio.gather(*(batcher.request(up, frame) for _ in range(3)))
        if fenced:
            table.mark_lost(1)  # (the batch's task hears it in the next loop round; its members end now)
        for m in members[:2]:
            m.close()
        await asyncio.sleep(0.3)
        return httpx.get(url + "/aborts").json()
    assert sorted(asyncio.run(go())) == ([] if fenced else [0, 1])


def promoted_after(delay_s: float, promoted_at: list[float], leaver: list[asyncio.Task] | None = None):
    """The supervisor's part on a shared KV pool: u1 exits; requests are held while u2 takes the pool
    over (`delay_s`), then u2 is primary (the moment noted in `promoted_at`). ``leaver``: its one
    request's client leaves during the hold."""
    async def supervise(table: RoutingTable, engines) -> None:
        (p1, url1), (_, url2), _ = engines
        table.set_primary(Upstream(url1, "u1", 1))
        while p1.poll() is None:
            await asyncio.sleep(0.005)
        table.mark_lost(1)
        table.set_primary(None, "u2 is taking the KV pool over")
        await asyncio.sleep(delay_s)
        if leaver:
            leaver[0].cancel()
            await asyncio.sleep(0.05)
        table.set_primary(Upstream(url2, "u2", 2))
        promoted_at.append(time.monotonic())
    return supervise


def streams_across(engines, n: int, supervisor, leaver: list[asyncio.Task] | None = None):
    """`n` streaming completions at once (6 tokens, u1 dies after its 3rd chunk of one): the
    responses (the first one's task in `leaver` if given, None for its response), the events."""
    async def go():
        table, events = RoutingTable(), []
        app = build_router(table, Metrics(), hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=10,
                           migration=MigrationSection(batch=BATCH), publish=events.append)
        watcher = asyncio.ensure_future(supervisor(table, engines))
        body = {"model": "m", "prompt": "p", "max_tokens": 6, "stream": True, "die_after": {"u1": 3}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r", timeout=30) as c:
            tasks = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(n)]
            if leaver is not None:
                leaver.append(tasks[0])
            answers = await asyncio.gather(*tasks, return_exceptions=True)
        watcher.cancel()
        return [a if isinstance(a, httpx.Response) else None for a in answers], events
    return asyncio.run(go())


def texts(r: httpx.Response) -> str:
    return "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in r.text.splitlines()
                   if ln.startswith("data: {"))


def test_a_failovers_continuations_leave_at_the_routing_change_that_brings_the_next_primary(engines, monkeypatch):
    """Continuations held while the next primary takes the pool over go to it from the routing
    table's change itself, together (batched); not once each request's task has run again. One
    each, they go the usual way, after the change."""
    monkeypatch.setattr("supervisor.router.migrating.SAME_PRIMARY_RETRY_S", 5.0)  # (a slow CI is slow to lose them)
    promoted_at: list[float] = []
    answers, events = streams_across(engines, 4, promoted_after(0.3, promoted_at))
    assert [texts(r) for r in answers] == ["t0 t1 t2 t3 t4 t5 "] * 4
    assert [e["result"] for e in events] == ["continued"] * 4
    sent = [e["timeline"]["sent"] for e in events]
    if BATCH:
        assert max(sent) <= promoted_at[0], (sent, promoted_at)
        assert len(httpx.get(engines[1][1] + "/peers").json()) == 1, "one batch"
    else:
        assert min(sent) > promoted_at[0], (sent, promoted_at)


def test_a_failovers_batch_goes_out_from_the_routing_change_on_the_connection_kept_to_the_next_primary(
        engines, monkeypatch):
    """The router keeps a connection open to the next primary (RoutingTable.set_next_primary): the
    held continuations' batch is written on it by the routing change itself. It reaches u2 while the
    supervisor's pass still holds the loop (blocked here for 1 s after the change), on that
    connection. One each, they go once the pass has ended, each as its own request."""
    monkeypatch.setattr("supervisor.router.migrating.SAME_PRIMARY_RETRY_S", 5.0)
    changed_at: list[float] = []

    async def supervise(table: RoutingTable, engines) -> None:
        (p1, url1), (_, url2), _ = engines
        table.set_primary(Upstream(url1, "u1", 1))
        table.set_next_primary(url2)
        while p1.poll() is None:
            await asyncio.sleep(0.005)
        table.mark_lost(1)
        table.set_primary(None, "u2 is taking the KV pool over")
        await asyncio.sleep(0.3)
        changed_at.append(time.monotonic())  # (before: the change itself writes the batch, u2 may stamp it first)
        table.set_primary(Upstream(url2, "u2", 2))
        time.sleep(1.0)  # (the rest of the pass: nothing else runs in the loop meanwhile)
        changed_at.append(time.monotonic())
    answers, events = streams_across(engines, 4, supervise)
    assert [texts(r) for r in answers] == ["t0 t1 t2 t3 t4 t5 "] * 4
    arrived = httpx.get(engines[1][1] + "/arrived_at").json()
    if BATCH:
        assert len(arrived) == 1 and changed_at[0] <= arrived[0] < changed_at[1], (changed_at, arrived)
        assert len(httpx.get(engines[1][1] + "/peers").json()) == 1
    else:
        assert len(arrived) == 4 and min(arrived) >= changed_at[1], (changed_at, arrived)


def test_a_continuation_whose_client_left_while_held_is_never_sent(engines, monkeypatch):
    monkeypatch.setattr("supervisor.router.migrating.SAME_PRIMARY_RETRY_S", 5.0)
    leaver: list[asyncio.Task] = []
    answers, events = streams_across(engines, 2, promoted_after(0.3, [], leaver), leaver)
    assert answers[0] is None and texts(answers[1]) == "t0 t1 t2 t3 t4 t5 "
    assert len(seen(engines[1][1])) == 1, "only the stayer's continuation reached u2"


def test_continuations_held_past_the_early_window_still_go_to_the_next_primary(engines):
    """A promotion slower than SAME_PRIMARY_RETRY_S: the continuations wait the usual way and go
    after the change."""
    promoted_at: list[float] = []
    answers, events = streams_across(engines, 2, promoted_after(0.8, promoted_at))
    assert [texts(r) for r in answers] == ["t0 t1 t2 t3 t4 t5 "] * 2
    assert min(e["timeline"]["sent"] for e in events) > promoted_at[0]


def test_continuations_held_when_the_router_stops_end_with_their_error(engines, caplog):
    """Streams cut by u1's death, held for the next primary when the supervisor stops: each ends
    with its error event and a cut connection, saying why."""
    async def stop_during_hold(table: RoutingTable, engines) -> None:
        (p1, url1), _, _ = engines
        table.set_primary(Upstream(url1, "u1", 1))
        while p1.poll() is None:
            await asyncio.sleep(0.005)
        table.mark_lost(1)
        table.set_primary(None, "u2 is taking the KV pool over")
        await asyncio.sleep(0.1)
        table.stop()
    answers, events = streams_across(engines, 2, stop_during_hold)
    assert answers == [None, None], "each stream is cut (after its error event)"
    assert [e["result"] for e in events] == ["failed"] * 2
    assert caplog.text.count("the supervisor is stopping") == 2, caplog.text
