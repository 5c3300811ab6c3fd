"""The launches that stalled in new primaries' first steps: reads promotion traces (the lines
engines/promotion_trace.py logs, one per failover; gpu_shared_kv.sh gathers them in
promotion_trace.txt) and prints, per failover, each shown step whose launch took over --over ms
(prepare + run + sample; one "launch" phase in the traces before 2026-12-05's nineteenth session),
with the step before it, its phases, CPU times and device memory growth; then how many failovers
had one.

    python3 bench/probes/trace_stalls.py promotion_trace.txt [--over 8]
"""
from __future__ import annotations

import argparse
import re

STEP = re.compile(r"\+(\d+): (\d+) rows (\d+) tokens, ([\d.]+) ms \(([-\d./]+)(?:, schedule's CPU [\d.]+)?"
                  r"(?:; CPU ([-\d./]+))?(?:; device memory \+(\d+) MiB)?\)")


def launch_ms(phases: list[float]) -> float:
    """The launch's ms: prepare/run/sample (7 phases) or the one launch phase (4 or 5)."""
    return sum(phases[1:4]) if len(phases) == 7 else phases[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--over", type=float, default=8.0)
    args = ap.parse_args()
    failovers = stalled = 0
    for line in open(args.trace):
        failovers += 1
        steps = STEP.findall(line)
        hits = []
        for i, (at, rows, tokens, _, wall, cpu, mib) in enumerate(steps):
            phases = [float(x) for x in wall.split("/")]
            if launch_ms(phases) <= args.over:
                continue
            before = f"after {steps[i - 1][1]} rows {steps[i - 1][2]} tokens" if i else "the first step"
            hits.append(f"step {i} at +{at} ({rows} rows {tokens} tokens, {before}): launch {launch_ms(phases):.1f} ms "
                        f"(phases {wall}" + (f"; CPU {cpu}" if cpu else "") + (f"; device memory +{mib} MiB" if mib else "")
                        + ")")
        stalled += bool(hits)
        print(f"failover {failovers}: " + ("; ".join(hits) or "none over the threshold"))
    print(f"{stalled} of {failovers} failovers had a launch over {args.over:g} ms in their first shown steps")


if __name__ == "__main__":
    main()
