"""The launches that stalled in new primaries' first steps: reads promotion traces (the lines
engines/promotion_trace.py logs, one per failover; gpu_shared_kv.sh gathers them in
promotion_trace.txt) and prints, per failover, each shown step whose prepare + run + sample took over
--over ms, with its phases, CPU times and device memory growth; then how many failovers had one.

    python3 bench/probes/trace_stalls.py promotion_trace.txt [--over 8]
"""
from __future__ import annotations

import argparse
import re

STEP = re.compile(r"\+(\d+): (\d+) rows (\d+) tokens, ([\d.]+) ms \(([-\d./]+)(?:; CPU ([-\d./]+))?"
                  r"(?:; device memory \+(\d+) MiB)?\)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--over", type=float, default=8.0)
    args = ap.parse_args()
    failovers = stalled = grew = 0
    for line in open(args.trace):
        failovers += 1
        hits = []
        for at, rows, tokens, _, wall, cpu, mib in STEP.findall(line):
            phases = [float(x) for x in wall.split("/")]
            grew += bool(mib)
            if len(phases) == 7 and sum(phases[1:4]) > args.over:
                hits.append(f"+{at} ({rows} rows, {tokens} tokens): prepare/run/sample {'/'.join(wall.split('/')[1:4])} ms"
                            + (f", CPU {'/'.join(cpu.split('/')[1:4])}" if cpu else "")
                            + (f", device memory +{mib} MiB" if mib else ""))
        stalled += bool(hits)
        print(f"failover {failovers}: " + ("; ".join(hits) or "none over the threshold"))
    print(f"{stalled} of {failovers} failovers had a launch over {args.over:g} ms in their first shown steps; "
          f"{grew} shown steps grew torch's device memory")


if __name__ == "__main__":
    main()
