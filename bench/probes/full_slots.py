"""Issue 52 (A): a node whose every slot is kept full of long streams on a loaded CPU must not fail
over; a hung primary must still be caught. A real node (the embedded default: tiny preset, CPU,
every failover setting at its default) behind `clients` closed-loop streaming clients (more than
`engines.max_num_seqs`, so requests always queue and a probe would queue behind them), each asking
`max_tokens` tokens with ignore_eos and asking again as soon as it ends, `busy` spinning processes
beside, for `duration` seconds. Then the primary is SIGSTOPped under the same load and the time from
the stop to the supervisor's detection of the hang is read from its failover event.

    python bench/probes/full_slots.py [--duration 600] [--busy 2] [--out DIR]
    python bench/probes/full_slots.py --clients 16 --max-model-len 1024 --max-tokens 1000  # streams in step

Prints (and writes to DIR/summary.json) failovers, engine (re)starts, the supervisor's probe lines
and the load's outcomes; DIR/supervisor.log is the supervisor's log."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness.load import Load
from harness.node import Harness, running
from supervisor.config import FailoverSection

PROBE_LINES = ("probe failed", "probe unanswered", "probe not made", ": READY -> FAILED", "is primary (epoch")


def node_config(workdir: Path, max_model_len: int | None = None) -> str:
    """The embedded default with a private runtime dir and free ports (and `max_model_len`, for
    streams longer than its 512 tokens): nothing else changed."""
    from supervisor.config_load import load_config
    cfg = load_config(None).model_dump()
    cfg["runtime_dir"] = str(workdir / "rt")
    cfg["router"]["port"] = cfg["admin"]["port"] = 0
    cfg["admin"]["token_file"] = None
    cfg["device"] = "cpu"
    if max_model_len:
        cfg["engines"]["max_model_len"] = max_model_len
    return yaml.safe_dump(cfg)


def failover_counter(h: Harness) -> float:
    """Sum of understudy_failovers_total over its reasons (the supervisor's /metrics)."""
    total = 0.0
    for line in h.metrics().splitlines():
        if line.startswith("understudy_failovers_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def log_lines(h: Harness) -> dict[str, int]:
    text = h.log.read_text(errors="replace")
    return {p: text.count(p) for p in PROBE_LINES}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    out: dict[str, Any] = {"busy_loops": args.busy, "duration_s": args.duration, "max_model_len": args.max_model_len}
    try:
        with running(work, node_config(work, args.max_model_len), ready_timeout_s=300) as h:
            st = h.wait_all_ready()
            model = httpx.get(h.router_url + "/v1/models", timeout=30).json()["data"][0]["id"]
            slots = int(yaml.safe_load(h.config.read_text())["engines"]["max_num_seqs"])
            clients = args.clients or slots + 4
            out.update(model=model, max_num_seqs=slots, clients=clients, max_tokens=args.max_tokens,
                       epoch_at_start=st["epoch"], pids_at_start={e["name"]: e["pid"] for e in st["engines"]},
                       failovers_metric_at_start=failover_counter(h))
            mark = len(h.events)
            body = {"prompt": "Once upon a time", "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0}
            samples: list[dict[str, Any]] = []
            with Load(h.router_url, model, threads=clients, stream=True, bodies=[body]) as load:
                t0 = time.monotonic()
                while (el := time.monotonic() - t0) < args.duration:
                    time.sleep(min(30.0, args.duration - el))
                    prim = h.primary()
                    samples.append({"t_s": round(time.monotonic() - t0, 1), "epoch": h.state["epoch"],
                                    "primary": prim["name"], "running": (prim.get("heartbeat") or {}).get("running"),
                                    "results": len(load.results), "failed": len(load.failures),
                                    "load1": os.getloadavg()[0]})
                    print(json.dumps(samples[-1]), flush=True)
                st = h.status()
                evs = h.events[mark:]
                out.update(epoch_at_end=st["epoch"], pids_at_end={e["name"]: e["pid"] for e in st["engines"]},
                           failovers_metric_at_end=failover_counter(h),
                           failover_events=[e for e in evs if e.get("type") == "failover"],
                           engine_transitions=Counter(f"{e['from']}->{e['to']}" for e in evs
                                                      if e.get("type") == "transition" and e.get("kind") == "engine"),
                           log_lines=log_lines(h), samples=samples)
                done = [r for r in load.results if r[2] == 200]
                out["load"] = {"requests_ended": len(load.results), "ok": len(done), "failed": len(load.failures),
                               "failures": [str(f[2])[:200] for f in load.failures[:10]],
                               "stream_seconds_median": sorted(r[1] - r[0] for r in done)[len(done) // 2] if done else None}
                # hangs are still caught: SIGSTOP the primary under the same load
                prim = h.primary()
                mark2 = len(h.events)
                t_stop = time.time()
                os.kill(prim["pid"], signal.SIGSTOP)
                ev = h.wait_event(lambda e: e.get("type") == "failover", timeout_s=60, since=mark2)
                detected = ev["ts"] - ev["seconds"]
                out["sigstop"] = {"primary": prim["name"], "reason": ev["reason"], "to": ev["to"],
                                  "stop_to_detection_s": round(detected - t_stop, 3),
                                  "detection_to_promotion_ms": round(ev["seconds"] * 1e3, 1),
                                  "heartbeat_timeout_s": FailoverSection().heartbeat_timeout_for("cpu")}
                h.wait_all_ready(120)
            out["sigstop"]["failed_after_stop"] = len(load.failures) - out["load"]["failed"]
    finally:
        for p in busy:
            p.kill()
            p.wait()
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(work / "supervisor.log", Path(args.out) / "supervisor.log")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of full slots (%(default)s)")
    p.add_argument("--busy", type=int, default=2, help="spinning processes beside the node (%(default)s)")
    p.add_argument("--clients", type=int, default=0, help="streaming clients (default: max_num_seqs + 4)")
    p.add_argument("--max-tokens", type=int, default=480, help="tokens a stream asks, ignore_eos (%(default)s)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="engines.max_model_len (default: the config's, 512), for longer streams")
    p.add_argument("--out", help="folder for summary.json and supervisor.log")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="full-slots-") as tmp:
        out = run(args, Path(tmp))
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.out:
        (Path(args.out) / "summary.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
