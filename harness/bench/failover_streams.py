"""`understudy bench failover --streams N`: the failover a client sees. N streams in flight through the
router (nano-like lengths, from enough client processes that the client is never the bottleneck: each
reports its own CPU), SIGKILL of the primary `--runs` times; per kill, the gap every stream in flight
saw across it, the supervisor's failover_seconds, tokens recomputed per continued stream, the standby
back; `--compare` runs the same with `engines.shared_kv: false` beside it (a node of its own)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from harness.bench.client_feel import client_feel
from harness.bench.failover_table import table
from harness.bench.private_node import bench_config, say
from harness.load.jobs import Gaps, Job, ProcessReport, TokenPrompts
from harness.load.processes import ClientProcesses, split
from harness.load.prompts import Lengths
from harness.load.result import GAP_WINDOW_S
from harness.prometheus import MetricsSnapshot
from harness.stats import bench_summary
from supervisor.router.migrating import TIMELINE

QUIET_AFTER_S = 5.0  # the standby READY -> a quiet window opens (the last failover's aftermath is over)

if TYPE_CHECKING:
    from harness.node import Harness


def run_node(args: argparse.Namespace, shared_kv: bool) -> dict[str, Any]:
    """One node (shared_kv on or off), the streams, the kills; the figures."""
    from harness.node import Harness
    workdir = Path(tempfile.mkdtemp(prefix="understudy-bench-streams-"))
    cfg = yaml.safe_load(bench_config(args.config, workdir, args))
    cfg["engines"]["shared_kv"] = shared_kv
    if problem := too_long(args, cfg["engines"]["max_model_len"]):
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"understudy bench failover: {problem}", file=sys.stderr)
        raise SystemExit(2)
    h = Harness(workdir, yaml.safe_dump(cfg), notify=False)
    try:
        h.wait_booted(args.boot_timeout)
        st = h.wait_all_ready(args.boot_timeout)
        with ClientProcesses(stream_jobs(args, h.router_url, st["model"]["name"], _vocab(st["model"]["path"]))) as load:
            say(args, f"shared_kv={shared_kv}: {args.streams} streams from {len(load.jobs)} client processes; "
                      f"warm-up {args.warmup:g} s")
            time.sleep(args.warmup)
            router = CpuShare(h.proc.pid)  # (the router runs in the supervisor's process)
            metrics_before = MetricsSnapshot.parse(h.metrics())
            k = kill_primaries(args, h)
            time.sleep(args.settle)
            supervisor_cpu = router.share()
            supervisor_gc = gc_pauses_between(metrics_before, MetricsSnapshot.parse(h.metrics()))
            load.stop()
            n = len(k.kills)
            reports = load.collect(marks=k.kills + k.quiet, within=args.gap_window,
                                   until=[None] * n + k.kills,  # (a quiet window ends by its kill)
                                   itl_marks=list(range(n, 2 * n)))
        recomputed = [n for e in h.events if e["type"] == "continuations" for n in e["recomputed"]]
        return {**summarize(args, shared_kv, reports, k.kills, k.failover_s, k.recovery_s, recomputed, k.quiet),
                "continuation_timeline_ms": timeline_after_kills(h.events, k.kills),
                "continuation_timeline_by_kill_ms": timeline_by_kill(h.events, k.kills),
                "promotion_in_engine_ms": bench_summary([x * 1000 for x in k.promotion_s], 2),
                "pool_adoption_ms": bench_summary([e["seconds"] * 1000 for e in h.events
                                                   if e["type"] == "kv_adopted" and e.get("seconds")], 2),
                "kill_to_detection_ms": bench_summary([x * 1000 for x in k.detected_s], 2),
                "supervisor_cpu_share": supervisor_cpu, "supervisor_gc": supervisor_gc,
                "primary_front_end_cpu_share": bench_summary(k.front_end_cpu)}
    finally:
        h.stop()
        if args.out:  # the supervisor's and every engine's log, for what the figures do not say
            keep_logs(workdir, Path(args.out) / f"logs-shared_kv-{str(shared_kv).lower()}.tgz")
        shutil.rmtree(workdir, ignore_errors=True)


def too_long(args: argparse.Namespace, max_model_len: int) -> str | None:
    """Why the streams' longest prompt and answer do not fit the node's context, if they do not (each
    would be refused: a run of errors, not a failover figure)."""
    inp, out = Lengths.parse(args.input_len, "--input-len"), Lengths.parse(args.output_len, "--output-len")
    if inp.hi + out.hi <= max_model_len:
        return None
    return (f"--input-len up to {inp.hi} + --output-len up to {out.hi} = {inp.hi + out.hi} tokens exceeds "
            f"engines.max_model_len {max_model_len} of the node's config: lower them, or raise it (-c FILE)")


def gc_pauses_between(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, dict[str, float]]:
    """The supervisor's garbage collections between two scrapes, per generation: how many, their
    total pause (ms), and how many paused over 10 ms (each such one stalled every stream)."""
    name = "understudy_supervisor_gc_pause_seconds"

    def grew(sample: str, **match: str) -> float:
        return after.total(sample, **match) - before.total(sample, **match)
    out = {}
    for g in "012":
        count = grew(f"{name}_count", generation=g)
        out[g] = {"count": int(count), "total_ms": round(grew(f"{name}_sum", generation=g) * 1e3, 1),
                  "over_10ms": int(count - grew(f"{name}_bucket", generation=g, le="0.01"))}
    return out


class CpuShare:
    """A process's CPU seconds (all its threads) per wall second since this was made: near 1.0 (or
    more, with threads) says it may be what holds the streams back."""

    def __init__(self, pid: int) -> None:
        import psutil
        self.proc = psutil.Process(pid)
        self.cpu0, self.t0 = self._cpu(), time.monotonic()

    def _cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def share(self) -> float:
        return round((self._cpu() - self.cpu0) / (time.monotonic() - self.t0), 3)


def front_end_share(engine: dict) -> CpuShare | None:
    """The CPU share of ``engine``'s HTTP front end process (engine-NAME-http), from now on."""
    import psutil
    try:
        for child in psutil.Process(engine["pid"]).children():
            if child.name() == f"engine-{engine['name']}-http":
                return CpuShare(child.pid)
    except psutil.Error:
        pass
    return None


@dataclass
class Kills:
    """What `kill_primaries` saw, per kill: when (time.monotonic, the client processes' clock), when
    the node was whole before it (the start of a quiet moment), failover_seconds, the standby back,
    the promotion inside the engine (shared KV only)."""

    kills: list[float] = field(default_factory=list)
    whole: list[float] = field(default_factory=list)
    quiet: list[float] = field(default_factory=list)  # the quiet window before each kill opens (whole + quiet_after)
    failover_s: list[float] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    promotion_s: list[float] = field(default_factory=list)
    detected_s: list[float] = field(default_factory=list)  # from the kill to the supervisor's detection
    front_end_cpu: list[float] = field(default_factory=list)  # the primary's HTTP front end, before each kill


def kill_primaries(args: argparse.Namespace, h: Harness) -> Kills:
    """SIGKILL the primary `--runs` times, each once the node is whole again (the standby READY) and
    has served for `--settle` s, and at least `--quiet-after` + `--gap-window` s: a quiet moment's
    window opens `--quiet-after` s after the node is whole (none of the last failover's aftermath in
    it) and closes before the kill."""
    k = Kills()
    settle = max(args.settle, args.quiet_after + args.gap_window + 0.1)
    stop = time.monotonic() + args.kill_for if args.kill_for else float("inf")
    for i in range(args.runs):
        h.wait_all_ready(args.boot_timeout)
        if time.monotonic() > stop:
            say(args, f"  --kill-for {args.kill_for:g} s passed: {i} of {args.runs} kills, the streams' side follows")
            break
        k.whole.append(time.monotonic())
        k.quiet.append(k.whole[-1] + args.quiet_after)
        old = h.primary()
        front = front_end_share(old)
        time.sleep(settle)
        if front is not None:
            k.front_end_cpu.append(front.share())
        mark = len(h.events)
        k.kills.append(time.monotonic())
        killed_at = time.time()
        os.killpg(old["pid"], signal.SIGKILL)
        ev = h.wait_event(lambda e: e["type"] == "failover", since=mark)
        k.failover_s.append(ev["seconds"])
        k.detected_s.append(ev["ts"] - ev["seconds"] - killed_at)  # (its wall clock, less the failover's time)
        if ev.get("promotion_s") is not None:  # (shared KV: the new primary taking the writer role)
            k.promotion_s.append(ev["promotion_s"])
        rec = h.wait_event(lambda e: e["type"] == "recovered" and e["engine"] == old["name"], since=mark,
                           timeout_s=args.boot_timeout)
        k.recovery_s.append(rec["seconds"])
        say(args, f"  kill {i + 1}/{args.runs}: detected {k.detected_s[-1] * 1e3:.1f} ms after the kill, failover "
                  f"{ev['seconds'] * 1e3:.1f} ms, standby back in "
                  f"{rec['seconds']:.2f} s")
    return k


def timeline_after_kills(events: list[dict[str, Any]], kills: list[float]) -> dict[str, dict[str, float]]:
    """Each moment of the continuations' timelines (supervisor/router/migrating.py TIMELINE), in ms
    after the kill that lost their primary (the last kill before the loss): where a stall goes."""
    per_kill = _moments_by_kill(events, kills)
    return {name: bench_summary([x for k in per_kill for x in k[name]], 2) for name in TIMELINE}


def timeline_by_kill(events: list[dict[str, Any]], kills: list[float]) -> list[dict[str, list[float]]]:
    """Per kill, each moment's median and max over its continuations ([] where it had none): whether
    a tail is a few slow failovers or every failover's slowest streams."""
    summaries = ({name: bench_summary(xs, 2) for name, xs in k.items()} for k in _moments_by_kill(events, kills))
    return [{name: [s["p50"], s["max"]] if s else [] for name, s in k.items()} for k in summaries]


def _moments_by_kill(events: list[dict[str, Any]], kills: list[float]) -> list[dict[str, list[float]]]:
    import bisect
    out: list[dict[str, list[float]]] = [{name: [] for name in TIMELINE} for _ in kills]
    for e in events:
        t = e.get("timeline") if e["type"] == "migration" and e.get("result") == "continued" else None
        if not t or "lost" not in t or (i := bisect.bisect_right(kills, t["lost"])) == 0:
            continue
        for name, at in t.items():
            if name in out[i - 1]:
                out[i - 1][name].append((at - kills[i - 1]) * 1000)
    return out


def keep_logs(workdir: Path, dest: Path) -> None:
    import tarfile
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for f in [workdir / "supervisor.log", *sorted((workdir / "rt" / "logs").glob("*.log*"))]:
            if f.exists():
                tar.add(f, arcname=f.name)


def stream_jobs(args: argparse.Namespace, url: str, model: str, vocab: int) -> list[Job]:
    """The streams dealt over the client processes, each with prompts of its own seed."""
    procs = max(1, min(args.client_procs, args.streams))
    return [Job(url=url, timeout_s=120.0, workers=n,
                requests=TokenPrompts(model=model, vocab=vocab, input_len=args.input_len, output_len=args.output_len,
                                      seed=1000 + i))
            for i, n in enumerate(split(args.streams, procs))]


def longest_waits(gaps: list[Gaps], kills: list[float], n: int = 5) -> list[dict[str, Any]]:
    """The `n` longest waits for tokens of the run, each placed: how long after the last kill before
    it began (None: before the first), how many token-bearing events its request had had, its
    request's error if it failed. (Where the rare seconds-long waits come from.)"""
    import bisect
    out = []
    for g in sorted(gaps, key=lambda g: g.longest, reverse=True)[:n]:
        i = bisect.bisect_right(kills, g.longest_at)
        out.append({"ms": round(g.longest * 1000, 2), "tokens_before": g.longest_after, "error": g.error,
                    "after_kill_ms": round((g.longest_at - kills[i - 1]) * 1000, 2) if i else None})
    return out


def summarize(args: argparse.Namespace, shared_kv: bool, reports: list[ProcessReport], kills: list[float],
              failover_s: list[float], recovery_s: list[float], recomputed: list[int],
              quiet: list[float] | None = None) -> dict[str, Any]:
    """Per kill, the gap every stream in flight saw across it; the same gap at quiet moments (the
    window from `quiet[i]` before each kill, its gaps ended by the kill); what the kill added to
    each stream in flight through both; the other streams' longest gaps (those not within `--window`
    of a kill); the failures; the client processes' CPU."""
    gaps: list[Gaps] = [g for r in reports for g in r.gaps]
    n = len(kills)
    across_kill = [[a for g in gaps if (a := g.across[k]) is not None] for k in range(n)]
    at_quiet = [a for g in gaps for a in g.across[n:] if a is not None]
    # what a kill added to a stream's longest wait: its gap across the kill less its own gap in the quiet
    # window before that kill (streams in flight through both: each set against its own quiet wait)
    added = [a - q for g in gaps for a, q in zip(g.across[:n], g.across[n:]) if a is not None and q is not None]
    calm = [g.longest for g in gaps if g.error is None and
            not any(g.sent - args.window < t < g.end + args.window for t in kills)]
    failed = [{"sent": g.sent, "end": g.end, "error": g.error} for g in gaps if g.error]
    ms = lambda xs: bench_summary([x * 1000 for x in xs], 2)  # noqa: E731
    return {
        "shared_kv": shared_kv, "streams": args.streams, "kills": n, "kills_asked": args.runs,
        "input_len": args.input_len, "output_len": args.output_len,
        "streams_in_flight_per_kill": {"min": min(map(len, across_kill), default=0),
                                       "max": max(map(len, across_kill), default=0)},
        "gap_window_s": args.gap_window, "quiet_after_s": args.quiet_after,
        **client_feel(gaps, kills, quiet if quiet is not None else kills, args.gap_window),
        "gap_across_kill_ms": ms([a for per_kill in across_kill for a in per_kill]),
        "gap_at_quiet_moments_ms": ms(at_quiet),
        "gap_added_by_kill_ms": ms(added),
        "longest_gap_other_streams_ms": ms(calm),
        "failover_seconds_ms": ms(failover_s), "standby_back_s": bench_summary(recovery_s),
        "recomputed_tokens_per_continuation": bench_summary(recomputed, 1),
        "continuations_recomputing_more_than_one": sum(n > 1 for n in recomputed),  # (no tail taken)
        "requests": len(gaps), "failed": len(failed), "failures": failed[:5],
        "longest_waits": longest_waits(gaps, kills),
        "client_cpu_share_max": round(max(r.cpu_s / (r.end - r.start) for r in reports), 3),
        "client_procs": len(reports),
    }


def _vocab(model_path: str) -> int:
    return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of the streaming mode (on `understudy bench failover`)."""
    p.add_argument("--streams", type=int, default=0, help="streaming mode: streams kept in flight (0: off)")
    p.add_argument("--client-procs", type=int, default=8, help="client processes for the streams")
    p.add_argument("--input-len", default="100:1024", help="prompt tokens per stream (N or LO:HI)")
    p.add_argument("--output-len", default="100:1024", help="tokens generated per stream (N or LO:HI)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first kill")
    p.add_argument("--window", type=float, default=2.0, help="seconds around a kill that make a stream not 'other'")
    p.add_argument("--gap-window", type=float, default=GAP_WINDOW_S,
                   help="seconds after a kill (or a quiet moment) whose longest wait for tokens is a stream's gap "
                        "(each kill waits at least this long after the node is whole)")
    p.add_argument("--quiet-after", type=float, default=QUIET_AFTER_S,
                   help="seconds after the standby is READY again before a quiet moment's window opens")
    p.add_argument("--kill-for", type=float, default=0.0,
                   help="seconds after which no new kill starts (the kills made so far are reported; 0: all --runs)")
    p.add_argument("--compare", action="store_true", help="also run with engines.shared_kv: false, beside it")
    p.add_argument("--out", help="keep each node's supervisor and engine logs here (a .tgz per node)")


def run_streams(args: argparse.Namespace) -> int:
    """Run the node(s); print the JSON, or a short table per node. Exit 1 if a request failed."""
    results = [run_node(args, True)] + ([run_node(args, False)] if args.compare else [])
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(table(r))
    return 0 if all(r["failed"] == 0 for r in results) else 1
