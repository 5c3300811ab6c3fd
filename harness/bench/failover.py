"""SIGKILL the primary under steady load, N times: kill -> first success.

`understudy bench failover` reports the time from the kill to the first success served by the new
primary (p50/p99) and counts failed requests. With `--streams N`, the failover a client sees instead
(harness/bench/failover_streams.py).

It starts its own supervisor (the given config, or the embedded default) with a private runtime
dir and free ports, so it never touches a production instance.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench.failover_streams import add_args as add_stream_args, run_streams
from harness.bench.private_node import add_kill_args, add_target_args, bench_config, say
from harness.stats import bench_summary, tail_text


def run(args: argparse.Namespace) -> dict[str, Any]:
    from harness.load import Load
    from harness.node import Harness
    workdir = Path(tempfile.mkdtemp(prefix="understudy-bench-"))
    h = Harness(workdir, bench_config(args.config, workdir, args), notify=False)
    kill_to_success: list[float] = []
    failover_s: list[float] = []
    recovery_s: list[float] = []
    sources: list[str] = []
    try:
        h.wait_booted(args.boot_timeout)
        st = h.wait_all_ready(args.boot_timeout)
        model = st["model"]["name"]
        overhead = router_overhead(h, model, args.overhead_requests, args.max_tokens) if args.overhead_requests else {}
        say(args, f"ready: {st['model']['path']} on {st['model']['device']}; {args.runs} runs, "
                   f"{args.concurrency} clients, {args.max_tokens} tokens per request")
        with Load(h.router_url, model, threads=args.concurrency, max_tokens=args.max_tokens) as load:
            for i in range(args.runs):
                h.wait_all_ready(args.boot_timeout)
                time.sleep(args.settle)
                old, new = h.primary(), h.standby()
                mark = len(h.events)
                t_kill = time.monotonic()
                got, when = load.watch(new["name"], t_kill)
                os.killpg(old["pid"], signal.SIGKILL)
                if not got.wait(60):
                    raise RuntimeError(f"run {i}: no success from {new['name']} within 60 s")
                t = when[0]
                kill_to_success.append(t - t_kill)
                ev = h.wait_event(lambda e: e["type"] == "failover", since=mark)
                failover_s.append(ev["seconds"])
                rec = h.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == old["name"],
                                   since=mark, timeout_s=args.boot_timeout)
                recovery_s.append(rec["seconds"])
                sources.append(rec.get("weights_source") or "")
                say(args, f"run {i + 1}/{args.runs}: kill -> first success {1000 * (t - t_kill):.1f} ms "
                           f"(supervisor failover {1000 * ev['seconds']:.2f} ms, replacement READY in "
                           f"{rec['seconds']:.2f} s, {rec.get('weights_source')})")
        requests, failed = len(load.results), len(load.failures)
        return {
            "bench": "failover", "runs": args.runs, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "device": st["model"]["device"], "model": st["model"]["path"], "dtype": st["model"]["dtype"],
            "kill_to_first_success_ms": bench_summary([x * 1000 for x in kill_to_success]),
            "supervisor_failover_ms": bench_summary([x * 1000 for x in failover_s]),
            "replacement_ready_s": bench_summary(recovery_s),
            "replacement_cache_hits": sum(s == "cache_hit" for s in sources),
            "requests": requests, "failed_requests": failed, "router_overhead_ms": overhead,
            "failures": [str(f[2]) for f in load.failures[:5]],
        }
    finally:
        h.stop()


def router_overhead(h, model: str, n: int, max_tokens: int) -> dict[str, float]:
    """Median latency through the router minus calling the primary directly (interleaved, no load)."""
    import httpx
    from wire import node_secret
    direct_url, secret = h.primary()["url"], node_secret.headers(h.rd)  # (the engine answers its node only)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.0}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=60) as c:
        for i in range(n + 10):
            for name, url in (("direct", direct_url), ("router", h.router_url)):
                t = time.perf_counter()
                c.post(url + "/v1/completions", json=body, headers=secret if name == "direct" else None
                       ).raise_for_status()
                if i >= 10:  # warm-up
                    times[name].append(time.perf_counter() - t)
    d, r = statistics.median(times["direct"]) * 1000, statistics.median(times["router"]) * 1000
    return {"direct_median": round(d, 3), "router_median": round(r, 3), "added_median": round(r - d, 3),
            "requests": n}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy bench failover", description=__doc__.splitlines()[0])
    add_target_args(p)
    add_kill_args(p, "primary", runs=10, settle=0.5)
    p.add_argument("--concurrency", type=int, default=2, help="clients sending back-to-back requests")
    p.add_argument("--overhead-requests", type=int, default=100,
                   help="interleaved direct/router requests to measure router overhead (0: skip)")
    add_stream_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.streams:
        return run_streams(args)
    if args.runs < 1 or args.concurrency < 1:
        p.error("--runs and --concurrency must be >= 1")
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        k = res["kill_to_first_success_ms"]
        print(f"kill -> first success by the new primary: median {k['p50']:.1f} ms, {tail_text(k)}; "
              f"supervisor failover median {res['supervisor_failover_ms']['p50']:.2f} ms; "
              f"failed requests {res['failed_requests']} of {res['requests']}; "
              f"replacements from cache {res['replacement_cache_hits']}/{res['runs']}")
        if res["router_overhead_ms"]:
            o = res["router_overhead_ms"]
            print(f"router overhead: median {o['added_median']:.2f} ms added ({o['router_median']:.2f} ms via the "
                  f"router vs {o['direct_median']:.2f} ms direct)")
    return 0 if res["failed_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
