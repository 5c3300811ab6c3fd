"""The schedule phase of each new primary's first admission steps, from promotion traces (the lines
`engines/core/promotion_trace.py` logs after a promotion, one per failover): per file, the schedule of the
first step with more than 16 rows, and of the steps of at most 16 rows before it (a failover's first
step often holds only the continuations that had arrived); and of the traced steps after the first,
how many had a run phase (the inputs' copy, the pending tokens' gather, the forward's launch) over
8 ms, those whose row count changed from the step before and those whose did not.

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
        big, small, runs = [], [], {"changed": [], "same": []}
        for line in open(path):
            if "continued requests admitted" not in line:
                continue
            steps = re.findall(r"\+\d+: (\d+) rows \d+ tokens, [\d.]+ ms \(([\d./]+);", line)
            for rows, phases in steps[:6]:
                if int(rows) > 16:
                    big.append(float(phases.split("/")[0]))
                    break
                small.append(float(phases.split("/")[0]))
            for (before, _), (rows, phases) in zip(steps, steps[1:]):
                runs["changed" if rows != before else "same"].append(float(phases.split("/")[2]))
        print(f"{path}: schedule of the first step of >16 rows, ms: {summary(big)}; "
              f"of the steps of <=16 rows before it: {summary(small)}; run phase over 8 ms in "
              + ", ".join(f"{sum(x > 8 for x in xs)} of {len(xs)} steps with rows {k}" for k, xs in runs.items()))


if __name__ == "__main__":
    main()
