"""What an HTTP hop costs per stream chunk, on the live path (real listener, real sockets), without a GPU:
CPU seconds of one process per chunk it relays, read from /proc, under closed-loop streaming clients
(harness/load: raw sockets, no HTTP library, so the clients cost little).

- `--target router`: the real router app on its listener, in front of a stand-in engine that streams
  engine-shaped chunks (token ids; `--prompt-ids` prompt ids in the first) every `--step-ms`.
- `--target engine --model DIR`: a real engine (`python -m engines`, CPU); the process measured is its
  HTTP front end, which turns the core's outputs into chunks. The clients ask for token ids, as the
  router does.

    python bench/probes/http_chunks.py --target router --clients 32 --tokens 64 --seconds 8
    python bench/probes/http_chunks.py --target engine --model /tmp/tiny --clients 16 --tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from cpu_share import cpu_seconds  # (this script's folder is on sys.path)

from harness.load.client import Client
from harness.load.request import Request
from harness.load.result import RequestResult
from harness.load.schedules import closed_loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROUTER = r'''
import asyncio, sys
from supervisor.effects.servers import bind_tcp, make_server
from supervisor.metrics import Metrics
from supervisor.router import build_router
from supervisor.router.routing import RoutingTable, Upstream
upstream, port = sys.argv[1], int(sys.argv[2])
async def main():
    table = RoutingTable()
    table.set_primary(Upstream(upstream, "e0", 1))
    app = build_router(table, Metrics(), hold_timeout_s=5, retry_after_s=1, upstream_timeout_s=30)
    sock = bind_tcp("127.0.0.1", port, "router")
    await make_server(app, sock, "warning", name="router").serve(sockets=[sock])
from wire import event_loop; event_loop.run(main())
'''


def chunk(i: int, n: int, prompt_ids: int) -> bytes:
    c: dict = {"index": 0, "text": f" t{i}", "logprobs": None,
               "finish_reason": "length" if i == n - 1 else None, "token_ids": [1000 + i]}
    if i == 0:
        c["prompt_token_ids"] = list(range(10, 10 + prompt_ids))
    data = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [c]},
                      separators=(",", ":")).encode()
    event = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args) -> None:
    """A stand-in engine: each request gets `tokens` chunks, one per `step_ms`, then [DONE]."""
    chunks = [chunk(i, args.tokens, args.prompt_ids) for i in range(args.tokens)]
    done = b"data: [DONE]\n\n"
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(ln.split(b":")[1] for ln in head.lower().split(b"\r\n")
                              if ln.startswith(b"content-length")))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for c in chunks:
                await asyncio.sleep(args.step_ms / 1000)
                writer.write(c)
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        writer.close()


async def load(port: int, args, seconds: float) -> list[RequestResult]:
    """`--clients` closed loops of one streamed completion after another (harness/load), each on a
    kept-alive connection, for `seconds`; the requests in flight then finish."""
    body = {"model": args.model_name, "prompt": [10 + i % 500 for i in range(args.prompt_ids)],  # a tiny vocabulary's
            "max_tokens": args.tokens, "stream": True, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    client = Client(f"http://127.0.0.1:{port}", 30.0, every_event=True)
    await closed_loop(client, itertools.repeat(Request.of(body)), args.clients, deadline=time.monotonic() + seconds)
    return client.results


async def router_target(args, stack: contextlib.ExitStack) -> tuple[int, int]:
    """The router in its own process, before a stand-in engine in ours: (port, pid to measure)."""
    srv = await asyncio.start_server(lambda r, w: engine(r, w, args), "127.0.0.1", 0)
    up_port = srv.sockets[0].getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    router = subprocess.Popen([sys.executable, "-c", ROUTER, f"http://127.0.0.1:{up_port}", str(port)],
                              cwd=ROOT)
    stack.callback(router.wait)
    stack.callback(router.terminate)
    for _ in range(200):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return port, router.pid
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError("the router did not listen")


async def engine_target(args, stack: contextlib.ExitStack) -> tuple[int, int]:
    """A real CPU engine: (its port, its HTTP front end's pid)."""
    import psutil

    from wire.engine_config import EngineConfig
    from harness.engine_process import EngineProcess
    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    cfg = EngineConfig(name="probe", model_path=args.model, port=0, runtime_dir=f"{tmp}/rt", weight_cache_mode="off",
                       max_model_len=args.prompt_ids + args.tokens + 8, max_num_seqs=args.clients)
    proc = EngineProcess(cfg, f"{tmp}/engine.log")
    stack.callback(proc.stop)
    await asyncio.to_thread(proc.wait_ready, 120)
    front = [c for c in psutil.Process(proc.pid).children() if c.name() == f"engine-{cfg.name}-http"[:15]]
    return proc.ready["port"], front[0].pid


async def main(args) -> dict:
    with contextlib.ExitStack() as stack:
        target = router_target if args.target == "router" else engine_target
        port, pid = await target(args, stack)
        await load(port, args, 1.0)  # warm-up
        cpu0, own0, t0 = cpu_seconds(pid), time.process_time(), time.monotonic()
        results = await load(port, args, args.seconds)
        cpu, own, wall = cpu_seconds(pid) - cpu0, time.process_time() - own0, time.monotonic() - t0
    chunks = sum(len(r.event_times) for r in results)  # data events, [DONE] too
    ok = [r for r in results if r.ok]
    if len(ok) < len(results):
        raise RuntimeError(f"{len(results) - len(ok)} of {len(results)} requests failed: {results[0].error}")
    return {"target": args.target, "clients": args.clients, "chunks": chunks,
            "chunks_per_s": round(chunks / wall), "cpu_share": round(cpu / wall, 3),
            "us_per_chunk": round(cpu / chunks * 1e6, 1),
            "clients_cpu_share": round(own / wall, 3),
            "ttft_p50_ms": round(statistics.median(r.ttft for r in ok) * 1e3, 2),
            "request_p50_ms": round(statistics.median(r.latency for r in ok) * 1e3, 1),
            "requests": len(ok)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=("router", "engine"), default="router")
    p.add_argument("--model", help="engine target: a model folder (e.g. `understudy make-model DIR --preset tiny`)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-ids", type=int, default=1532)
    p.add_argument("--step-ms", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=8.0)
    a = p.parse_args()
    a.model_name = os.path.basename(a.model.rstrip("/")) if a.model else "m"
    sys.path.insert(0, ROOT)
    print(json.dumps(asyncio.run(main(a))))
