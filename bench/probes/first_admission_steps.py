"""The schedule phase of each new primary's first admission steps, from promotion traces (the lines
`engines/promotion_trace.py` logs after a promotion, one per failover): per file, the schedule of the
first step with more than 16 rows, and of the steps of at most 16 rows before it (a failover's first
step often holds only the continuations that had arrived).

    python3 bench/probes/first_admission_steps.py promotion_traces_*.txt
"""
from __future__ import annotations

import re
import statistics
import sys


def summary(xs: list[float]) -> str:
    if not xs:
        return "none"
    return f"median {statistics.median(xs):.1f} (min {min(xs):.1f}, max {max(xs):.1f}, n {len(xs)})"


def main() -> None:
    for path in sys.argv[1:]:
        big, small = [], []
        for line in open(path):
            if "continued requests admitted" not in line:
                continue
            for _at, rows, sched in re.findall(r"\+(\d+): (\d+) rows \d+ tokens, [\d.]+ ms \(([\d.]+)/", line)[:6]:
                if int(rows) > 16:
                    big.append(float(sched))
                    break
                small.append(float(sched))
        print(f"{path}: schedule of the first step of >16 rows, ms: {summary(big)}; "
              f"of the steps of <=16 rows before it: {summary(small)}")


if __name__ == "__main__":
    main()
