"""Whether a request gives the same text alone, under load and across failovers (`understudy bench determinism`).

Starts its own supervisor (the given config or the embedded default, `engines.deterministic: true`
unless `--default-mode`), answers each of `--prompts` prompts once alone, greedy and seeded at
temperature 0.8 (the reference), then sends them again from `--clients` concurrent clients in a
loop (harness/load) for `--duration` seconds with no fault, and again for as long while the
primary is SIGKILLed `--kills` times, each when a stream is mid-answer (its streams continued on the
standby; a stream with no token yet is only sent again). It counts the replies
identical to the reference, by phase and kind: the claim is 100%, reported as counts.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from harness.bench.arg_types import positive_float, positive_int
from harness.bench.private_node import add_target_args, bench_config, say
from harness.stats import bench_summary

WORDS = ("the river ran past old stone walls while a quiet wind carried news of rain from distant hills "
         "and every traveller who passed the bridge stopped to listen to the water speak of seasons gone").split()
PREAMBLE = "You are a careful assistant. Answer briefly and never repeat yourself. "  # a shared prefix (cache hits)


def request_bodies(n: int, max_tokens: int, max_words: int = 120, seed: int = 0) -> list[dict]:
    """`n` prompts of varied length, up to `max_words` words (half behind a shared preamble), each
    greedy and seeded at temperature 0.8: 2n bodies."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.choice([3, max_words // 10, max_words // 3, max_words])
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, words)))
        prompt = (PREAMBLE if i % 2 else "") + text
        base = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        out += [{**base, "temperature": 0}, {**base, "temperature": 0.8, "seed": 1000 + i}]
    return out


def kind(body: dict) -> str:
    return "greedy" if body["temperature"] == 0 else "seeded"


def reference(url: str, model: str, bodies: list[dict], stream: bool) -> list[str]:
    """Each body answered alone, one after the other."""
    from harness.load import Load
    solo = Load(url, model, threads=1, stream=stream)
    return [solo.one(b) for b in bodies]


MID_ANSWER_WAIT_S = 2.0  # a kill waits at most this long for a stream that has had tokens


def wait_mid_answer(load, timeout_s: float) -> int:  # noqa: ANN001 (harness.load.Load)
    """Until a stream of the load has had tokens and not ended (a kill then continues it; one that
    had none yet is only sent again), at most `timeout_s`: how many there are."""
    deadline = time.monotonic() + timeout_s
    while not (mid := load.mid_answer()) and time.monotonic() < deadline:
        time.sleep(0.002)
    return mid


def phase(h, model: str, bodies: list[dict], ref: list[str], args: argparse.Namespace, kills: int) -> dict[str, Any]:  # noqa: ANN001
    """Load for args.duration s (killing the primary `kills` times, evenly spaced); the counts."""
    from harness.load import Load
    killed, gaps, mark = 0, [], len(h.events)
    with Load(h.router_url, model, threads=args.clients, bodies=bodies, stream=not args.no_stream) as load:
        start = time.monotonic()
        for i in range(kills):
            time.sleep(max(0.0, start + (i + 1) * args.duration / (kills + 1) - time.monotonic()))
            h.wait_all_ready(args.boot_timeout)
            old = h.primary()
            mid = wait_mid_answer(load, MID_ANSWER_WAIT_S)
            t = time.monotonic()
            os.killpg(old["pid"], signal.SIGKILL)
            killed += 1
            h.wait_for(lambda st: st["primary"] not in (None, old["name"]), 60, "a new primary")
            gaps.append(time.monotonic() - t)
            say(args, f"kill {killed}/{kills}: {old['name']} (pid {old['pid']}) with {mid} streams mid-answer, "
                      f"{len(load.replies)} replies so far")
        time.sleep(max(0.0, start + args.duration - time.monotonic()))
    by_kind: dict[str, dict[str, int]] = {}
    mismatches = []
    for index, text in list(load.replies):
        k = by_kind.setdefault(kind(bodies[index]), {"replies": 0, "identical": 0})
        k["replies"] += 1
        if text == ref[index]:
            k["identical"] += 1
        elif len(mismatches) < 5:
            mismatches.append({"body": index, "kind": kind(bodies[index]), "want": ref[index][:120], "got": text[:120]})
    replies = sum(k["replies"] for k in by_kind.values())
    continued = sum(len(e["recomputed"]) for e in h.events[mark:] if e["type"] == "continuations")  # (the engines' own count)
    return {"kills": killed, "continued": continued, "replies": replies, "identical": sum(k["identical"] for k in by_kind.values()),
            "by_kind": by_kind, "failed": len(load.failures), "failures": [str(f[2]) for f in load.failures[:5]],
            "mismatches": mismatches, "kill_to_new_primary_s": bench_summary(gaps)}


def node_config(args: argparse.Namespace, workdir: Path) -> str:
    cfg = yaml.safe_load(bench_config(args.config, workdir, argparse.Namespace(**{**vars(args), "runs": args.kills})))
    cfg["engines"]["deterministic"] = not args.default_mode
    if args.dtype:
        cfg["model"]["dtype"] = args.dtype
    return yaml.safe_dump(cfg)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from harness.node import Harness
    workdir = Path(tempfile.mkdtemp(prefix="understudy-bench-det-"))
    h = Harness(workdir, node_config(args, workdir), notify=False)
    try:
        h.wait_booted(args.boot_timeout)
        st = h.wait_all_ready(args.boot_timeout)
        model = st["model"]["name"]
        modes = {e["name"]: e["heartbeat"].get("deterministic") for e in st["engines"]}
        bodies = request_bodies(args.prompts, args.max_tokens, args.max_words)
        say(args, f"ready: {st['model']['path']} on {st['model']['device']} ({st['model']['dtype']}), "
                  f"deterministic engines: {modes}; {len(bodies)} requests, alone first")
        ref = reference(h.router_url, model, bodies, not args.no_stream)
        out: dict[str, Any] = {"bench": "determinism", "device": st["model"]["device"], "model": st["model"]["path"],
                               "dtype": st["model"]["dtype"], "deterministic": not args.default_mode,
                               "engines_say": modes, "node_says": st["model"].get("deterministic"),
                               "requests": len(bodies), "clients": args.clients,
                               "duration_s": args.duration, "max_tokens": args.max_tokens,
                               "stream": not args.no_stream, "phases": {}}
        for name, kills in (("no faults", 0), ("kills", args.kills)):
            if name == "kills" and not kills:
                continue
            say(args, f"{name}: {args.clients} clients for {args.duration:.0f} s" + (f", {kills} kills" if kills else ""))
            res = out["phases"][name] = phase(h, model, bodies, ref, args, kills)
            say(args, f"{name}: {res['identical']} of {res['replies']} replies identical to the solo run "
                      f"(the engines continued {res['continued']} streams), {res['failed']} failed")
        return out
    finally:
        h.stop()


def table(res: dict[str, Any]) -> str:
    rows = [f"{'phase':10} {'kind':7} {'identical':>18} {'failed':>7}"]
    for name, p in res["phases"].items():
        for k, c in sorted(p["by_kind"].items()):
            rows.append(f"{name:10} {k:7} {c['identical']:>8} of {c['replies']:<8} {p['failed']:>7}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy bench determinism", description=__doc__.splitlines()[0])
    add_target_args(p)
    p.add_argument("--prompts", type=positive_int, default=32, help="prompts, each sent greedy and seeded")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens generated per answer (EOS ignored)")
    p.add_argument("--max-words", type=positive_int, default=120, help="the longest prompt, in words")
    p.add_argument("--clients", type=positive_int, default=32, help="concurrent streaming clients")
    p.add_argument("--duration", type=positive_float, default=60.0, help="seconds of load per phase")
    p.add_argument("--kills", type=int, default=0, help="SIGKILLs of the primary in the second phase (0: no such phase)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="overrides model.dtype")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    p.add_argument("--default-mode", action="store_true", help="engines.deterministic false (to see the difference)")
    p.add_argument("--boot-timeout", type=positive_float, default=900.0, help="seconds the node may take to be READY")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = run(args)
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else table(res))
    ok = all(ph["identical"] == ph["replies"] and not ph["failed"] for ph in res["phases"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
