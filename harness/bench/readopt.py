"""SIGKILL the supervisor under load, N times, and start it again.

`understudy bench supervisor-restart` starts it again on the same listening sockets (as systemd's
understudy.socket + Restart= would), under open-loop load. Reports, per kill: the time until
requests are served again, when the children were re-adopted, requests lost (in flight inside the
killed process), connections refused, and engine restarts (an engine whose pid changed). Target
(issue 12): 0 refused, 0 engine restarts, serving within 2 s.

It starts its own supervisor (the given config, or the embedded default) with a private runtime dir
and its own listening sockets, so it never touches a production instance.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.bench.private_node import add_kill_args, add_target_args, bench_config, say
from harness.stats import bench_summary

ADOPTED_LINE = "re-adopted from the previous supervisor"


def _children(st: dict[str, Any]) -> dict[str, int | None]:
    ids = {e["name"]: e["pid"] for e in st["engines"]}
    ids.update({d["name"]: d["pid"] for d in st["daemons"]})
    ids["spawn-server"] = (st.get("spawn_server") or {}).get("pid")
    return ids


def _stamp(line: str) -> float:
    """Wall time of a supervisor log line."""
    stamp = line.split(" understudy ")[0]
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:23]) / 1000


def _adopted_at(log: Path, timeout_s: float) -> tuple[float, float, float] | tuple[None, None, None]:
    """A new supervisor's (first log line, re-adoption log line) wall times, and the seconds from its
    process start to the re-adoption as it logs them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if " understudy " in ln]
        for line in lines:
            if ADOPTED_LINE in line:
                since_start = float(line.split(" s after this process started")[0].rsplit(", ", 1)[1])
                return _stamp(lines[0]), _stamp(line), since_start
        time.sleep(0.05)
    return None, None, None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from harness.handover import listening
    from harness.load import OpenLoad
    from harness.node import Harness
    workdir = Path(tempfile.mkdtemp(prefix="understudy-bench-"))
    text = bench_config(args.config, workdir, args)
    held = {"router": listening(), "admin": listening()}
    (workdir / "sup0").mkdir()
    h = Harness(workdir / "sup0", text, notify=False, held=held)
    runs: list[dict[str, Any]] = []
    try:
        h.wait_booted(args.boot_timeout)
        st = h.wait_all_ready(args.boot_timeout)
        model = st["model"]["name"]
        say(args, f"ready: {st['model']['path']} on {st['model']['device']}; {args.runs} supervisor kills "
                   f"at {args.rate:g} req/s")
        load = OpenLoad(h.router_url, model, args.rate, args.max_tokens).start()
        try:
            for i in range(args.runs):
                before = _children(h.wait_all_ready(args.boot_timeout))
                time.sleep(args.settle)
                t_kill, wall_kill = time.monotonic(), time.time()
                h.proc.kill()
                h.proc.wait()
                h.stop()
                (workdir / f"sup{i + 1}").mkdir()
                h = Harness(workdir / f"sup{i + 1}", text, notify=False, held=held)
                served = _first_success_after(load, t_kill, 60.0)
                first_log, adopted, process_s = _adopted_at(h.log, 60.0)
                h.wait_booted(args.boot_timeout)
                after = _children(h.wait_all_ready(args.boot_timeout))
                res = list(load.results)
                lost = [r for r in res if r[0] < t_kill <= r[1] and r[2] not in ("ok", "refused")]  # in flight
                refused = [r for r in res if t_kill <= r[0] < t_kill + 10 and r[2] == "refused"]
                runs.append({"serving_again_s": None if served is None else round(served - t_kill, 3),
                             "adopted_s": None if adopted is None else round(adopted - wall_kill, 3),
                             "first_log_line_s": None if first_log is None else round(first_log - wall_kill, 3),
                             "process_start_to_adopted_s": process_s,
                             "lost": len(lost), "refused": len(refused),
                             "engine_restarts": sum(before[k] != after.get(k) for k in before)})
                say(args, f"kill {i + 1}/{args.runs}: serving again {runs[-1]['serving_again_s']} s, children "
                           f"re-adopted at {runs[-1]['adopted_s']} s (first log line at "
                           f"{runs[-1]['first_log_line_s']} s; "
                           f"{process_s} s after its process started), lost {len(lost)}, refused "
                           f"{runs[-1]['refused']}, restarted children {runs[-1]['engine_restarts']}")
        finally:
            load.stop()
        results = load.results
        return {
            "bench": "supervisor-restart", "runs": args.runs, "rate": args.rate, "max_tokens": args.max_tokens,
            "device": st["model"]["device"], "model": st["model"]["path"],
            "serving_again_s": bench_summary([r["serving_again_s"] for r in runs if r["serving_again_s"] is not None]),
            "adopted_s": bench_summary([r["adopted_s"] for r in runs if r["adopted_s"] is not None]),
            "process_start_to_adopted_s": bench_summary([r["process_start_to_adopted_s"] for r in runs
                                                     if r["process_start_to_adopted_s"] is not None]),
            "lost": sum(r["lost"] for r in runs), "refused": sum(r[2] == "refused" for r in results),
            "children_restarted": sum(r["engine_restarts"] for r in runs),
            "requests": len(results), "failed_requests": sum(r[2] != "ok" for r in results),
            "per_kill": runs,
        }
    finally:
        h.stop()
        for s in held.values():
            s.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _first_success_after(load, t_kill: float, timeout_s: float) -> float | None:
    """End time of the first request answered 200 after the kill (served by the new supervisor)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ends = [end for _, end, out in list(load.results) if out == "ok" and end > t_kill]
        if ends:
            return min(ends)
        time.sleep(0.01)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy bench supervisor-restart", description=__doc__.splitlines()[0])
    add_target_args(p)
    add_kill_args(p, "supervisor", runs=5, settle=2.0)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second, each on a new connection")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.runs < 1 or args.rate <= 0:
        p.error("--runs must be >= 1 and --rate > 0")
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        s, a = res["serving_again_s"], res["adopted_s"]
        print(f"SIGKILL of the supervisor -> serving again: p50 {s.get('p50')} s, max {s.get('max')} s; children "
              f"re-adopted p50 {a.get('p50')} s; refused {res['refused']}, children restarted "
              f"{res['children_restarted']}, lost {res['lost']} (in flight in the killed supervisor) of "
              f"{res['requests']} requests")
    ok = res["refused"] == 0 and res["children_restarted"] == 0 and res["failed_requests"] == res["lost"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
