"""What the router's process (or another: `--process`) holds per stream in flight, and what its
garbage collections cost.

Starts a node (the given config, else the embedded default on this machine's device) with a
sitecustomize that, in the processes watched only, logs every collection of generation 1 and 2
(pause, objects collected) and every `--census` s the tracked objects outside the frozen startup
set, by type, with the items the largest containers hold; streams `--streams` nano-like streams from
`--procs` client processes for `--seconds`, then prints per-stream objects and the pauses.

    python bench/probes/router_heap.py --streams 256 --seconds 60 -c node.yaml [--collect] [--cycles S] [--kill S [--kills N]] [--out DIR]

With `--watch CMD...` it starts no node and no load of its own: it runs CMD (the real `understudy bench
failover --streams ...`, say) with the sitecustomize in its environment, and reports over CMD's whole run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SITECUSTOMIZE = textwrap.dedent('''
    import gc, json, os, re, threading, time
    from collections import Counter

    _WANT = re.compile(os.environ.get("ROUTER_HEAP_PROCESS", "supervisor serve"))
    _on = [False]  # this process is one to watch (its name can change after a fork: checked at each census)
    _began = [0.0]

    def _name():
        try:
            comm = open("/proc/self/comm").read().strip()
            argv = open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")
        except OSError:
            return ""
        return f"{comm} {argv}"

    def _write(record):
        record.update(t=time.monotonic(), pid=os.getpid())
        _out.write(json.dumps(record) + "\\n")

    def _timed(phase, info):
        if not _on[0]:
            return
        if phase == "start":
            _began[0] = time.perf_counter()
        elif info["generation"] >= 1:
            _write({"gen": info["generation"], "collected": info["collected"],
                    "ms": round((time.perf_counter() - _began[0]) * 1e3, 3)})

    def _census():
        while True:
            time.sleep(float(os.environ["ROUTER_HEAP_CENSUS_S"]))
            name = _name()
            _on[0] = bool(_WANT.search(name))
            if not _on[0]:
                continue
            if os.environ.get("ROUTER_HEAP_COLLECT"):  # a full collection now, timed by _timed
                gc.collect()
            objs = gc.get_objects()
            kinds = Counter(type(o).__name__ for o in objs)
            items = Counter()
            for o in objs:
                if isinstance(o, (list, dict, tuple, set, bytearray)) and len(o) > 64:
                    items[type(o).__name__] += len(o)
            _write({"name": name[:60], "tracked": len(objs), "frozen": gc.get_freeze_count(),
                    "collections": [g["collections"] for g in gc.get_stats()],
                    "top": kinds.most_common(25), "big_container_items": dict(items)})
            del objs

    def _label(o):
        name = type(o).__name__
        if name in ("function", "coroutine"):
            return f"{name} {getattr(o, '__qualname__', '?')}"
        if name == "frame":
            return f"frame {o.f_code.co_filename.rsplit('/', 1)[-1]}:{o.f_code.co_name}"
        if name == "cell":
            try:
                return f"cell({type(o.cell_contents).__name__})"
            except ValueError:
                return "cell(empty)"
        return name

    def _edge(a, b):
        if isinstance(a, dict):
            for k, v in a.items():
                if v is b:
                    return f"[{k!r}]"
        return ""

    def _cycle(start, ids):
        # a shortest path of references from start back to itself, inside the garbage
        prev, queue = {id(start): None}, [start]
        for o in queue:
            for r in gc.get_referents(o):
                if r is start:
                    path, x = [o], o
                    while prev[id(x)] is not None:
                        x = prev[id(x)]
                        path.append(x)
                    path.reverse()
                    return path + [start]
                if id(r) in ids and id(r) not in prev:
                    prev[id(r)] = o
                    queue.append(r)
        return None

    def _cycles():
        time.sleep(float(os.environ["ROUTER_HEAP_CYCLES_AT"]))
        if not _WANT.search(_name()):
            return
        gc.collect()
        time.sleep(20)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        gc.set_debug(0)
        garbage = list(gc.garbage)
        gc.garbage.clear()
        ids = {id(o) for o in garbage}
        kinds = Counter(_label(o) for o in garbage)
        seen, paths = set(), []
        for o in garbage:
            lab = _label(o)
            if lab in seen or kinds[lab] < 20 or len(paths) >= 12:
                continue
            seen.add(lab)
            path = _cycle(o, ids)
            if path:
                paths.append(" -> ".join(_label(x) + _edge(x, y) for x, y in zip(path, path[1:] + [None])))
        _write({"name": _name()[:60], "garbage": len(garbage), "garbage_kinds": kinds.most_common(40), "cycles": paths})
        del garbage

    def _start():
        threading.Thread(target=_census, daemon=True).start()
        if os.environ.get("ROUTER_HEAP_CYCLES_AT"):
            threading.Thread(target=_cycles, daemon=True).start()

    if "ROUTER_HEAP_OUT" in os.environ:
        _out = open(os.environ["ROUTER_HEAP_OUT"], "a", buffering=1)
        gc.callbacks.append(_timed)
        _start()
        os.register_at_fork(after_in_child=_start)  # (engines are forked: their threads are not)
''')


def report(args: argparse.Namespace, lines: list[dict], loaded: float, ended: float) -> None:
    """One watched process's census, cycles and collections."""
    census = [x for x in lines if "tracked" in x]
    print(f"== pid {lines[0]['pid']}: {census[-1]['name'] if census else '?'}")
    idle = [x for x in census if x["t"] < loaded]
    busy = [x for x in census if loaded + args.census < x["t"] < ended]
    gcs = [x for x in lines if "gen" in x and loaded + args.census < x["t"] < ended]  # (not the node's stop)
    base = idle[-1]["tracked"] if idle else 0
    for x in busy:
        print(f"busy: {x['tracked']} tracked ({(x['tracked'] - base) / args.streams:.0f} a stream over idle {base}), "
              f"big containers' items {x['big_container_items']}")
        print("  " + ", ".join(f"{k} {n}" for k, n in x["top"][:14]))
    for x in lines:
        if "garbage" in x:
            print(f"cyclic garbage over 20 s: {x['garbage']} objects; " + ", ".join(f"{k} {n}" for k, n in x["garbage_kinds"][:20]))
            for c in x["cycles"]:
                print("  cycle: " + c)
    if len(busy) > 1:
        span = busy[-1]["t"] - busy[0]["t"]
        made = [b - a for a, b in zip(busy[0]["collections"], busy[-1]["collections"])]
        print(f"collections per minute under load (generations 0, 1, 2; forced ones included): "
              f"{', '.join(f'{n * 60 / span:.1f}' for n in made)} over {span:.0f} s")
    for gen in (1, 2):
        ms = [x["ms"] for x in gcs if x["gen"] == gen]
        if ms:
            print(f"generation {gen}: {len(ms)} collections under load, median {statistics.median(ms):.2f} ms, "
                  f"max {max(ms):.2f} ms, collected median {statistics.median(x['collected'] for x in gcs if x['gen'] == gen)}")


def read_log(args: argparse.Namespace, log: Path) -> list[dict]:
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "heap.jsonl").write_text(log.read_text())
    return lines


def watch(args: argparse.Namespace, log: Path, env: dict[str, str]) -> int:
    """`--watch`: CMD under the sitecustomize; each watched process's report from its first census on."""
    import subprocess
    rc = subprocess.call(args.watch, env={**os.environ, **env})
    lines = read_log(args, log) if log.exists() else []
    print(f"{args.watch[0]}... exited {rc}")
    for pid in dict.fromkeys(x["pid"] for x in lines):
        mine = [x for x in lines if x["pid"] == pid]
        first = min((x["t"] for x in mine if "tracked" in x), default=0.0)
        report(args, mine, first - args.census + 0.01, max(x["t"] for x in mine) + 1)
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", help="supervisor config (default: the embedded default)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--procs", type=int, default=4, help="client processes")
    p.add_argument("--input-len", default="100:1024", help="prompt tokens per stream (N or LO:HI; with the "
                                                          "output, within the model's context)")
    p.add_argument("--output-len", default="100:1024", help="tokens generated per stream (N or LO:HI)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--census", type=float, default=10.0, help="seconds between counts of the heap")
    p.add_argument("--process", default="supervisor serve",
                   help="watch the processes whose name and command line match this (e.g. 'engine-.-http': front ends)")
    p.add_argument("--collect", action="store_true", help="collect the oldest generation at each census (timed)")
    p.add_argument("--cycles", type=float, help="also, this many seconds after the supervisor starts, save 20 s of "
                                                "its cyclic garbage and print a reference cycle of each common kind")
    p.add_argument("--kill", type=float, help="SIGKILL the primary this many seconds into the load")
    p.add_argument("--kills", type=int, default=1, help="with --kill: this many kills, --kill seconds apart (each once the standby is back)")
    p.add_argument("--out", help="keep the probe's raw log here")
    p.add_argument("--watch", nargs=argparse.REMAINDER, help="run this command instead of a node and load of our own")
    args = p.parse_args()

    from harness.bench.failover_streams import _vocab
    from harness.bench.private_node import bench_config
    from harness.load.jobs import Job, TokenPrompts
    from harness.load.processes import ClientProcesses, split
    from harness.node import Harness

    work = Path(tempfile.mkdtemp(prefix="router-heap-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = work / "heap.jsonl"
    env = {"PYTHONPATH": os.pathsep.join([str(work / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ROUTER_HEAP_OUT": str(log), "ROUTER_HEAP_CENSUS_S": str(args.census), "ROUTER_HEAP_PROCESS": args.process}
    if args.collect:
        env["ROUTER_HEAP_COLLECT"] = "1"
    if args.cycles:
        env["ROUTER_HEAP_CYCLES_AT"] = str(args.cycles)
    if args.watch:
        return watch(args, log, env)
    node_args = argparse.Namespace(preset=None, model=None, device=None, runs=0, max_tokens=4)
    h = Harness(work, bench_config(args.config, work, node_args), notify=False, env=env)
    try:
        h.wait_booted(600)
        st = h.wait_all_ready(600)
        model, vocab = st["model"]["name"], _vocab(st["model"]["path"])
        time.sleep(args.census + 1)  # one census of the idle node
        loaded = time.monotonic()
        jobs = [Job(url=h.router_url, timeout_s=300.0, workers=n,
                    requests=TokenPrompts(model=model, vocab=vocab, input_len=args.input_len,
                                          output_len=args.output_len, seed=1000 + i))
                for i, n in enumerate(split(args.streams, args.procs))]
        with ClientProcesses(jobs) as load:
            kills = args.kills if args.kill is not None else 0
            for _ in range(kills):
                time.sleep(args.kill)
                h.wait_all_ready(120)  # (a standby to take over)
                os.killpg(h.primary()["pid"], signal.SIGKILL)
            time.sleep(max(0.0, args.seconds - kills * (args.kill or 0)))
            ended = time.monotonic()
            load.stop()
            gaps = [g for r in load.collect(marks=[]) for g in r.gaps]
    finally:
        h.stop()
    lines = read_log(args, log)
    failed = [g.error for g in gaps if g.error]
    print(f"requests: {len(gaps)}, failed {len(failed)}" + (f" (first: {failed[0][:200]})" if failed else ""))
    for pid in dict.fromkeys(x["pid"] for x in lines):
        report(args, [x for x in lines if x["pid"] == pid], loaded, ended)
    return 0


if __name__ == "__main__":
    sys.exit(main())
