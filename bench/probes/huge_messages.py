"""Huge message lists against a real engine (CPU, tiny model): the front end's CPU per refused
request, and a normal request's latency while such requests arrive (issue 23, item 4).

    python bench/probes/huge_messages.py [--bad 16] [--messages 230000] [--max-model-len 512] [--shape bad-ids]

Phase 1: `--bad` chat bodies of `--messages` short messages each (`--shape bad-ids`: completion
bodies of one token id then `--messages` strings), sent together with nothing else
running; prints their status and the front end's CPU seconds per request. Phase 2: one client sends
normal chat requests back to back (baseline first, alone), then the bad ones arrive again while it
goes on; prints the normal requests' median and max latency in both windows. Run it against
another tree with PYTHONPATH=that-tree (the engine child inherits it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from wire.engine_config import EngineConfig
from harness.engine_process import EngineProcess
from models.make_model import make_model


def frontend_pid(engine_pid: int, name: str) -> int:
    """The engine's HTTP front end: its child named engine-NAME-http."""
    for child in psutil.Process(engine_pid).children():
        if child.name() == f"engine-{name}-http"[:15]:
            return child.pid
    raise RuntimeError("no front-end process found")


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def send_bad(url: str, path: str, body: bytes, count: int) -> list[tuple[int, str]]:
    """`count` bad requests at once; each answer's status and error code."""
    def one(_: int) -> tuple[int, str]:
        r = httpx.post(url + path, content=body, timeout=600,
                       headers={"content-type": "application/json"})
        return r.status_code, r.json().get("error", {}).get("code") or ""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def normal_loop(url: str, model: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """Normal chat requests back to back until `stop`; appends (start, latency) of each."""
    body = {"model": model, "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4,
            "temperature": 0}
    with httpx.Client(timeout=600) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            r = c.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out.append((t0, time.monotonic() - t0))


def summary(lat: list[float]) -> str:
    return f"median {statistics.median(lat) * 1000:.1f} ms, max of {len(lat)} {max(lat) * 1000:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bad", type=int, default=16)
    ap.add_argument("--messages", type=int, default=230_000)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--baseline-s", type=float, default=3.0)
    ap.add_argument("--shape", choices=["messages", "bad-ids"], default="messages")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="huge-messages-"))
    model = make_model(work / "tiny", "tiny", "llama", seed=0)
    cfg = EngineConfig(name="probe", model_path=str(model), port=0, runtime_dir=str(work / "rt"),
                       weight_cache_mode="off", max_model_len=args.max_model_len, max_num_seqs=8)
    proc = EngineProcess(cfg, work / "engine.log")
    try:
        proc.wait_ready(120)
        fe = frontend_pid(proc.pid, cfg.name)
        if args.shape == "messages":
            path, req = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * args.messages}
        else:
            path, req = "/v1/completions", {"prompt": [1] + ["a"] * args.messages}
        body = json.dumps({"model": model.name, **req}).encode()
        print(f"bad body: {len(body)} bytes, {args.shape} x {args.messages}; {args.bad} at once")
        before = cpu_s(fe)
        t0 = time.monotonic()
        answers = send_bad(proc.url, path, body, args.bad)
        wall = time.monotonic() - t0
        per = (cpu_s(fe) - before) / args.bad
        print(f"phase 1: answers {sorted(set(answers))}; front end CPU {per:.3f} s per bad request; "
              f"all {args.bad} answered in {wall:.2f} s")
        lat: list[tuple[float, float]] = []
        stop = threading.Event()
        loop = threading.Thread(target=normal_loop, args=(proc.url, model.name, stop, lat))
        loop.start()
        time.sleep(args.baseline_s)
        start = time.monotonic()
        send_bad(proc.url, path, body, args.bad)
        end = time.monotonic()
        stop.set()
        loop.join()
        base = [d for t, d in lat if t + d < start]
        during = [d for t, d in lat if t < end and t + d > start]  # overlapping the bad ones' window
        print(f"phase 2: normal chat alone: {summary(base)}; while {args.bad} bad ones arrive: {summary(during)}")
        print("RESULT " + json.dumps({"cpu_s_per_bad": round(per, 4), "bad_wall_s": round(wall, 3),
                                      "normal_alone_median_s": round(statistics.median(base), 4),
                                      "normal_during_median_s": round(statistics.median(during), 4),
                                      "normal_during_max_s": round(max(during), 4), "n_during": len(during),
                                      "answers": sorted(set(answers))}))
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
