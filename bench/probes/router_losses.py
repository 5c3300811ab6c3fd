"""What a failover's losses cost the router, in its own loop: N streams relayed through a real router
(supervisor/router, on uvloop, on a socket) from a stand-in engine (a process of its own, streaming
token ids forever) to a client (another process), then the primary is fenced (`mark_lost`, a hold):
the time from the fence until every stream's continuation waits built for the next primary
(batching.Batcher.at_next_primary), per round, and with --profile the router's functions that
took it. On an H200 host the fourteenth session's 256 losses were still being handled ~10 ms after
detection (bench/RESULTS.md): the next primary's answer waits for all of them (one loop round).

    python bench/probes/router_losses.py [--streams 256] [--prompt 600] [--rounds 5] [--profile]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing
import pstats
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ENGINE = textwrap.dedent('''
    import asyncio, json, sys
    import uvicorn
    PROMPT = list(range(int(sys.argv[2])))

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        i = 0
        while True:
            choice = {"index": 0, "text": "t ", "finish_reason": None, "token_ids": [i % 1000]}
            if i == 0:
                choice["prompt_token_ids"] = PROMPT
            chunk = {"id": "cmpl-x", "created": 1, "model": "m", "object": "text_completion", "choices": [choice]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\\n\\n",
                        "more_body": True})
            i += 1
            await asyncio.sleep(0.02)

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
''')


def clients(url: str, n: int) -> None:
    """(Its own process.) n streaming completions, until the router ends them."""
    import httpx

    async def one(c: httpx.AsyncClient) -> None:
        try:
            async with c.stream("POST", "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 100000,
                                                                "stream": True}) as r:
                async for _ in r.aiter_raw():
                    pass
        except httpx.HTTPError:
            pass

    async def go() -> None:
        limits = httpx.Limits(max_connections=n + 8)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            await asyncio.gather(*(one(c) for _ in range(n)))
    asyncio.run(go())


async def measure(args: argparse.Namespace, engine_url: str) -> list[float]:
    from supervisor.effects.servers import bind_tcp, make_server
    from supervisor.metrics import Metrics
    from supervisor.router import build_router
    from supervisor.router.routing import RoutingTable, Upstream

    from engines.block_keys import key_root
    table = RoutingTable()
    app = build_router(table, Metrics(), hold_timeout_s=30, retry_after_s=1, upstream_timeout_s=60,
                       key_chain=(key_root(False), 16))  # (as `understudy serve` builds it)
    batcher = next(f.__self__ for f in table.on_change)  # (the router's Batcher: whose members wait)
    sock = bind_tcp("127.0.0.1", 0, "router")
    server = make_server(app, sock, "warning")
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    took, profile = [], cProfile.Profile() if args.profile else None
    for epoch in range(1, args.rounds + 1):
        table.stopping = False
        table.set_primary(Upstream(engine_url, "e", epoch))
        client = multiprocessing.get_context("spawn").Process(
            target=clients, args=(f"http://127.0.0.1:{sock.getsockname()[1]}", args.streams), daemon=True)
        client.start()
        while len(table._calls.get(epoch, ())) < args.streams:  # every stream relaying
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # (several chunks each)
        if profile:
            profile.enable()
        t0 = time.perf_counter()
        table.mark_lost(epoch)
        table.set_primary(None, "promoting")
        while len(batcher._early) < args.streams:
            await asyncio.sleep(0)
        took.append(time.perf_counter() - t0)
        if profile:
            profile.disable()
        table.stop()  # (never sent: each request ends with its error; its client with them)
        while client.is_alive():
            await asyncio.sleep(0.05)
    server.should_exit = True
    await serving
    if profile:
        pstats.Stats(profile).sort_stats(args.sort).print_stats(25)
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sort", default="tottime")
    args = p.parse_args()
    from engines import event_loop
    from engines.loopback import free_port
    port = free_port()
    script = Path(tempfile.mkdtemp()) / "engine.py"
    script.write_text(ENGINE)
    engine = subprocess.Popen([sys.executable, str(script), str(port), str(args.prompt)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        took = event_loop.run(measure(args, url))
    finally:
        engine.kill()
    ms = [t * 1e3 for t in took]
    print(f"{args.streams} streams of a {args.prompt}-id prompt: fence -> every continuation built and waiting, "
          f"median {statistics.median(ms):.2f} ms of {len(ms)} (min {min(ms):.2f}, max {max(ms):.2f}); "
          f"{1e3 * statistics.median(ms) / args.streams:.1f} us a stream")


if __name__ == "__main__":
    main()
