"""Router against a real upstream (a small FastAPI app in a subprocess): pass-through, streaming,
holding during a failover, retry on a new primary, 503 + Retry-After, /healthz and /readyz."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from wire.loopback import free_port
from supervisor.config import MigrationSection
from supervisor.metrics import Metrics
from supervisor.router import build_router
from supervisor.router.routing import RoutingTable, Upstream

UPSTREAM = textwrap.dedent('''
    import asyncio, json, sys
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    import uvicorn
    app = FastAPI()
    NAME = sys.argv[2]

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
        if body.get("fail_on") == NAME:  # an engine refusing work, as a draining one does
            return JSONResponse({"error": {"message": "draining"}}, status_code=503)
        if body.get("stream"):
            async def gen():
                for i in range(int(body.get("n", 3))):
                    yield f"data: {json.dumps({'i': i, 'from': NAME})}\\n\\n"
                    await asyncio.sleep(float(body.get("delay", 0.01)))
                yield "data: [DONE]\\n\\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        if body.get("sleep_on", NAME) == NAME:
            await asyncio.sleep(float(body.get("sleep", 0)))
        return {"choices": [{"text": "ok"}], "from": NAME, "echo": body.get("prompt")}

    @app.get("/v1/models")
    async def models(request: Request):
        return {"data": [{"id": "m"}], "query": str(request.url.query)}

    @app.get("/v1/peer")
    async def peer(request: Request):
        return {"port": request.client.port}

    @app.get("/v1/chunked")
    async def chunked():
        async def gen():
            for i in range(5):
                yield json.dumps({"part": i}) + "\\n"
        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.get("/health")
    async def health():
        return {}

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
''')


def start_upstream(tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "upstream.py"
    script.write_text(UPSTREAM)
    port = free_port()
    p = subprocess.Popen([sys.executable, str(script), str(port), name])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            time.sleep(0.05)
    p.kill()
    raise RuntimeError("upstream did not start")


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    procs = [start_upstream(tmp, n) for n in ("u1", "u2")]
    yield [url for _, url in procs]
    for p, _ in procs:
        p.kill()
        p.wait()


def run(coro):
    return asyncio.run(coro)


def make(hold_s: float = 2.0, upstream_timeout_s: float = 10):
    table = RoutingTable()
    metrics = Metrics()
    app = build_router(table, metrics, hold_timeout_s=hold_s, retry_after_s=7, upstream_timeout_s=upstream_timeout_s,
                       migration=MigrationSection(enabled=False))  # this upstream is no engine: pass-through
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router", timeout=20)
    return table, metrics, client


def test_forwards_to_the_primary_and_passes_errors_through(upstreams):
    async def go():
        table, metrics, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))
        r = await c.post("/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 200 and r.json()["from"] == "u1" and r.json()["echo"] == "hello"
        assert r.headers["x-understudy-engine"] == "a" and r.headers["x-understudy-epoch"] == "1"
        bad = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not JSON" in bad.text
        q = await c.get("/v1/models?limit=3")
        assert q.json()["query"] == "limit=3"
        text = metrics.render().decode()
        assert 'understudy_router_requests_total{code="200"} 2.0' in text
        assert 'understudy_router_requests_total{code="400"} 1.0' in text
    run(go())


def test_a_body_over_the_large_body_size_reaches_the_engine_whole(upstreams):
    """The upstream client writes a large body (a failover's batch) after its head without joining
    them (supervisor/router/upstream.py LARGE_BODY): the engine still gets every byte, in order."""
    from supervisor.router.upstream import LARGE_BODY

    async def go():
        table, _, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))
        prompt = "".join(chr(97 + i % 26) for i in range(LARGE_BODY * 3))
        r = await c.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 200 and r.json()["echo"] == prompt
    run(go())


def test_the_engines_batch_endpoints_and_the_continuation_field_are_not_for_clients(upstreams):
    async def go():
        table, metrics, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))
        for path in ("/v1/continuations", "/v1/continuations/abort"):
            r = await c.post(path, json={"requests": []})
            assert r.status_code == 404 and "router's own endpoint" in r.json()["error"]["message"], r.text
        for path in ("/v1/completions", "/v1/chat/completions"):  # nor the field that jumps the engine's queue
            r = await c.post(path, json={"prompt": "x", "continuation": {"prompt_token_ids": [1],
                                                                          "output_token_ids": [2]}})
            assert r.status_code == 400 and "router's own field" in r.json()["error"]["message"], r.text
    run(go())


def test_streams_are_passed_through(upstreams):
    async def go():
        table, _, c = make()
        table.set_primary(Upstream(upstreams[1], "b", 4))
        async with c.stream("POST", "/v1/completions", json={"stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            body = b"".join([chunk async for chunk in r.aiter_raw()]).decode()
        events = [ln for ln in body.splitlines() if ln.startswith("data:")]
        assert len(events) == 4 and '"from": "u2"' in events[0] and events[-1] == "data: [DONE]"
    run(go())


def test_no_primary_holds_then_503_with_retry_after(upstreams):
    async def go():
        table, metrics, c = make(hold_s=0.3)
        table.set_primary(None, "failover in progress")
        r = await c.post("/v1/completions", json={})
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert "failover in progress" in r.json()["error"]["message"]
        text = metrics.render().decode()
        assert "understudy_router_hold_seconds_count 1.0" in text
        held = float(text.split("understudy_router_hold_seconds_sum ")[1].split()[0])
        assert held >= 0.3, text  # it held for the whole hold_timeout_s (its own clock), then answered
    run(go())


def test_requests_during_a_failover_wait_for_the_new_primary(upstreams):
    async def go():
        table, _, c = make()
        table.set_primary(None, "failover")

        async def switch():
            await asyncio.sleep(0.2)
            table.set_primary(Upstream(upstreams[1], "b", 2))
        asyncio.create_task(switch())
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["from"] == "u2" and r.headers["x-understudy-epoch"] == "2"
    run(go())


def test_failed_upstream_before_first_byte_is_retried_on_the_new_primary(upstreams):
    async def go():
        table, metrics, c = make()
        table.set_primary(Upstream(f"http://127.0.0.1:{free_port()}", "dead", 1))  # nothing listens

        async def switch():
            await asyncio.sleep(0.1)
            table.set_primary(Upstream(upstreams[0], "a", 2))
        asyncio.create_task(switch())
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["from"] == "u1"
        assert "understudy_router_retries_total 1.0" in metrics.render().decode()
    run(go())


def test_dead_primary_and_no_replacement_gives_503_naming_the_failure():
    async def go():
        table, _, c = make(hold_s=0.5)
        table.set_primary(Upstream(f"http://127.0.0.1:{free_port()}", "dead", 1))
        r = await c.post("/v1/completions", json={})
        assert r.status_code == 503 and "dead: ConnectError" in r.json()["error"]["message"]
    run(go())


def test_held_requests_get_503_at_once_when_the_supervisor_stops():
    async def go():
        table, _, c = make(hold_s=30)
        table.set_primary(None, "failover")

        async def stop():
            await asyncio.sleep(0.2)
            table.stop()
        asyncio.create_task(stop())
        r = await c.post("/v1/completions", json={})  # (hold_timeout_s 30: only the stop can end it)
        assert r.status_code == 503 and "stopping" in r.json()["error"]["message"]
        assert (await c.get("/readyz")).json()["reason"] == "supervisor is stopping"
    run(go())


def test_healthz_and_readyz():
    async def go():
        table, _, c = make()
        assert (await c.get("/healthz")).status_code == 200
        table.set_primary(None, "starting: no engine READY yet")
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "starting: no engine READY yet"
        table.set_primary(Upstream("http://127.0.0.1:1", "a", 3))
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json() == {"ready": True, "primary": "a", "epoch": 3}
        table.drained = True
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "node is drained"
        assert (await c.get("/healthz")).json() == {"ok": True}
        r = await c.post("/readyz")  # outside /v1 only the probes, GET only, in the OpenAI error shape
        assert r.status_code == 405 and r.headers["allow"] == "GET"
        assert r.json()["error"]["message"] == "Method Not Allowed (POST /readyz)"
        r = await c.get("/v2/models")
        assert r.status_code == 404 and r.json()["error"] == {
            "message": "Not Found (GET /v2/models)", "type": "invalid_request_error", "param": None, "code": 404}
    run(go())


def test_the_lifespan_closes_the_upstream_connections():
    """uvicorn's lifespan protocol, by hand: startup completes; shutdown closes the pooled
    connection (the upstream sees it end), then completes."""
    async def go():
        ended = asyncio.Event()

        async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.read()  # until the router closes its kept-alive connection
            ended.set()
        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        table = RoutingTable()
        table.set_primary(Upstream(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "a", 1))
        app = build_router(table, Metrics(), hold_timeout_s=1, retry_after_s=1, upstream_timeout_s=5,
                           migration=MigrationSection(enabled=False))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            assert (await c.get("/v1/models")).status_code == 200
        inbox: asyncio.Queue = asyncio.Queue()
        for msg in ("lifespan.startup", "lifespan.shutdown"):
            inbox.put_nowait({"type": msg})
        sent: list[str] = []

        async def send(msg: dict) -> None:
            sent.append(msg["type"])
        await app({"type": "lifespan"}, inbox.get, send)
        assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
        await asyncio.wait_for(ended.wait(), 5)
        server.close()
    run(go())


def test_upstream_connections_are_kept_alive_but_dropped_after_a_timeout(upstreams):
    async def go():
        table, metrics, c = make(upstream_timeout_s=1.0)  # (every request here must answer within it)
        table.set_primary(Upstream(upstreams[0], "a", 1))
        ports = {(await c.get("/v1/peer")).json()["port"] for _ in range(3)}
        assert len(ports) == 1  # one keep-alive connection
        r = await c.post("/v1/completions", json={"sleep": 3, "prompt": "slow"})  # 3 s: over the 1 s timeout
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        r = await c.post("/v1/completions", json={"prompt": "after"})  # not the slow one's late answer
        assert r.status_code == 200 and r.json()["echo"] == "after"
        await asyncio.sleep(3)  # (the slow answer's time has passed: it must not surface now)
        r = await c.post("/v1/completions", json={"prompt": "later"})
        assert r.status_code == 200 and r.json()["echo"] == "later"
        text = metrics.render().decode()
        assert 'understudy_router_requests_total{code="504"} 1.0' in text
        assert "understudy_router_retries_total 0.0" in text  # a timeout is never retried
    run(go())


def test_a_request_to_a_fenced_primary_is_retried_on_the_new_one_at_once(upstreams):
    async def go():
        table, metrics, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))

        async def fence():
            await asyncio.sleep(0.2)
            table.mark_lost(1)
            table.set_primary(Upstream(upstreams[1], "b", 2))
        asyncio.create_task(fence())
        r = await c.post("/v1/completions", json={"sleep": 3, "sleep_on": "u1", "prompt": "x"})
        # answered by u2: retried when u1 was fenced, not after u1's own (3 s) answer, which is u1's
        assert r.status_code == 200 and r.json()["from"] == "u2" and r.headers["x-understudy-epoch"] == "2"
        assert "understudy_router_retries_total 1.0" in metrics.render().decode()
    run(go())


def test_a_refusing_engine_is_retried_on_the_new_primary(upstreams):
    async def go():
        table, _, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))

        async def switch():
            await asyncio.sleep(0.1)
            table.set_primary(Upstream(upstreams[1], "b", 2))
        asyncio.create_task(switch())
        r = await c.post("/v1/completions", json={"fail_on": "u1", "prompt": "x"})
        assert r.status_code == 200 and r.json()["from"] == "u2"
        table2, _, c2 = make(hold_s=0.3)  # no other primary: retried on the same one, then our 503
        table2.set_primary(Upstream(upstreams[0], "a", 1))
        r = await c2.post("/v1/completions", json={"fail_on": "u1"})
        assert r.status_code == 503 and "a: HTTP 503" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "7"
    run(go())


def test_chunked_responses_are_read_whole_and_methods_outside_the_api_refused(upstreams):
    async def go():
        table, _, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))
        r = await c.get("/v1/chunked")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        assert r.headers["content-length"] == str(len(r.content))
        assert [json.loads(ln)["part"] for ln in r.text.splitlines()] == [0, 1, 2, 3, 4]
        for method in ("HEAD", "OPTIONS"):
            assert (await c.request(method, "/v1/models")).status_code == 405
        assert (await c.get("/nothing")).status_code == 404
    run(go())


def test_an_upstream_that_breaks_before_its_body_is_whole_is_retried(upstreams):
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"par")
        await writer.drain()
        writer.close()

    async def go():
        server = await asyncio.start_server(broken, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        table, metrics, c = make(hold_s=0.5)
        table.set_primary(Upstream(f"http://127.0.0.1:{port}", "broken", 1))
        r = await c.post("/v1/completions", json={})
        assert r.status_code == 503 and "broken: RemoteProtocolError" in r.json()["error"]["message"]

        async def switch():
            await asyncio.sleep(0.1)
            table.set_primary(Upstream(upstreams[0], "a", 2))
        asyncio.create_task(switch())
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["from"] == "u1"
        server.close()
    run(go())


def test_a_stream_ends_when_its_client_goes_away(upstreams):
    async def go():
        table, metrics, _ = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))
        app = build_router(table, metrics, hold_timeout_s=2, retry_after_s=7, upstream_timeout_s=10)
        gone = asyncio.Event()
        sent: list[dict] = []
        requested = False

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                body = {"stream": True, "n": 10**6, "delay": 0.05}  # a stream that never ends by itself
                return {"type": "http.request", "body": json.dumps(body).encode()}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                gone.set()  # the client leaves after its first event
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")]}
        await asyncio.wait_for(app(scope, receive, send), 60)  # the upstream's stream never ends by itself
        assert sent[0]["status"] == 200 and len([m for m in sent if m.get("body")]) < 5
    run(go())


def test_failover_clock_stops_when_a_stream_first_reaches_the_client_not_when_it_ends(upstreams):
    """A stream that is the new primary's first success ends the failover clock at its first chunk,
    as clients time it (its end would inflate understudy_failover_seconds): the figure observed is
    never more than the client's own clock start -> first chunk, and less than start -> end."""
    async def go():
        table, metrics, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 2))
        start = time.monotonic()
        table.start_failover_clock(2, start)
        first = None
        async with c.stream("POST", "/v1/completions", json={"stream": True, "n": 10, "delay": 0.05}) as r:
            async for chunk in r.aiter_raw():
                first = first or time.monotonic()
        end = time.monotonic()
        text = metrics.render().decode()
        count = float(text.split("understudy_failover_seconds_count ")[1].split()[0])
        seconds = float(text.split("understudy_failover_seconds_sum ")[1].split()[0])
        assert count == 1 and 0 < seconds <= first - start < end - start, (seconds, first - start, end - start)
    run(go())


def failover_observations(metrics) -> tuple[float, float]:
    text = metrics.render().decode()
    return (float(text.split("understudy_failover_seconds_count ")[1].split()[0]),
            float(text.split("understudy_failover_seconds_sum ")[1].split()[0]))


def test_a_quiet_nodes_failover_clock_stops_at_the_promotion_and_every_failover_is_observed_once(upstreams):
    """An operator's review: a promotion on an idle node was observed when the next request came (+20 s of
    idle time), and a failover no request ended before the next one was never observed. Now with no
    request in progress the clock stops at the promotion; one still running at the next failover stops at
    its own promotion (here a stream in progress on epoch 2 while epochs 3 and 4 are promoted)."""
    async def go():
        table, metrics, c = make()
        table.set_primary(Upstream(upstreams[0], "a", 1))
        start = time.monotonic()
        table.start_failover_clock(1, start)  # (nothing in progress)
        promoted = time.monotonic() - start
        await asyncio.sleep(0.3)
        assert (await c.post("/v1/completions", json={})).status_code == 200
        count, seconds = failover_observations(metrics)
        assert count == 1 and seconds <= promoted < 0.3, (seconds, promoted)
        table.set_primary(Upstream(upstreams[0], "a", 2))
        stream = asyncio.create_task(c.post("/v1/completions", json={"stream": True, "n": 10, "delay": 0.05}))
        while not table.requests_in_progress:
            await asyncio.sleep(0.005)
        table.start_failover_clock(3, time.monotonic())  # (a stream in progress: the clock runs)
        await asyncio.sleep(0.2)
        assert failover_observations(metrics)[0] == 1
        table.start_failover_clock(4, time.monotonic())
        count, total = failover_observations(metrics)
        assert count == 2 and total - seconds < 0.05  # epoch 3's, stopped at its promotion
        assert (await stream).status_code == 200 and table.requests_in_progress == 0
    run(go())


def test_message_lists_over_the_limits_are_refused_by_the_router_before_any_engine(upstreams):
    """Issue 23: the router bounds a chat body's messages and their characters on the parsed JSON
    (wire/limits.py check_body), as the engines do, so a huge list costs one parse and no engine
    (external ones included) sees it; this upstream has no chat route: a forwarded body would get 404."""
    from wire.limits import RequestLimits
    table, metrics = RoutingTable(), Metrics()
    table.set_primary(Upstream(upstreams[0], "a", 1))
    app = build_router(table, metrics, hold_timeout_s=2, retry_after_s=7, upstream_timeout_s=10,
                       migration=MigrationSection(enabled=False),
                       limits=RequestLimits(max_messages=10, max_message_chars=100))

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r", timeout=20) as c:
            many = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "x"}] * 11})
            long = await c.post("/v1/chat/completions", json={"model": "m", "messages": [
                {"role": "user", "content": "a" * 60}, {"role": "user", "content": [{"type": "text", "text": "b" * 41}]}]})
            ok = await c.post("/v1/completions", json={"prompt": "hello"})
            return [many, long, ok]
    many, long, ok = run(go())
    assert many.status_code == 400 and many.json()["error"]["code"] == "max_messages", many.text
    assert "11 messages; at most 10" in many.json()["error"]["message"]
    assert long.status_code == 400 and long.json()["error"]["code"] == "max_message_chars", long.text
    assert "101 characters; at most 100" in long.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["from"] == "u1"
    assert 'understudy_router_requests_total{code="400"} 2.0' in metrics.render().decode()


def test_the_router_parses_a_body_with_the_garbage_collector_paused():
    """A body of 200,000 small lists would set off hundreds of collections over a growing heap
    (issue 23); parsed with the GC paused, none, and the GC runs again afterwards."""
    import gc

    from supervisor.router.continuation import parse_request
    body = json.dumps({"model": "m", "prompt": [[1]] * 200_000}).encode()
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])
    gc.callbacks.append(count)
    try:
        req = parse_request("/v1/completions", body)
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
    assert len(req["prompt"]) == 200_000 and collections == []
    assert parse_request("/v1/completions", b"{not json") is None
