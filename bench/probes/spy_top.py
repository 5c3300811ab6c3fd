"""Where processes spend their CPU, from `py-spy record -f raw` output (one line per distinct stack:
`frame;frame;... count`; with --subprocesses each stack begins with its process).

    python3 bench/probes/spy_top.py OUT.raw [--top 25] [--match TEXT]

Per process (the innermost `process PID:"command"` frame py-spy gave, a child's below its parent's): samples, then the functions holding the most
samples with everything they called (inclusive) and by themselves (self). --match keeps the
processes whose first frame holds TEXT."""
from __future__ import annotations

import argparse
import collections
import re


def name(frame: str) -> str:
    """`func (path/file.py:line)` as `func file.py`: one entry per function, not per line."""
    m = re.match(r"(.*?) \((?:.*/)?([^/:]+):\d+\)$", frame)
    return f"{m[1]} {m[2]}" if m else frame


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("raw")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--match", default="")
    a = p.parse_args()
    procs: dict[str, tuple[collections.Counter, collections.Counter, list[int]]] = {}
    for line in open(a.raw, errors="replace"):
        stack, _, count = line.strip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        marks = [i for i, f in enumerate(frames) if f.startswith("process ")]  # (a child's below its parent's)
        proc = frames[marks[-1]] if marks else "(one process)"
        frames = frames[marks[-1] + 1:] if marks else frames
        if a.match not in proc or not frames:
            continue
        inclusive, own, total = procs.setdefault(proc, (collections.Counter(), collections.Counter(), [0]))
        n = int(count)
        total[0] += n
        for f in {name(f) for f in frames}:
            inclusive[f] += n
        own[name(frames[-1])] += n
    for proc, (inclusive, own, total) in sorted(procs.items(), key=lambda kv: -kv[1][2][0]):
        print(f"== {proc[:120]}: {total[0]} samples")
        print("  inclusive:")
        for f, n in inclusive.most_common(a.top):
            print(f"    {n:7d} {100 * n / total[0]:5.1f}%  {f[:110]}")
        print("  self:")
        for f, n in own.most_common(a.top):
            print(f"    {n:7d} {100 * n / total[0]:5.1f}%  {f[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
