"""Where a failover's time went between the engines and the supervisor, from a node's logs (a .tgz
that `understudy bench failover --out DIR` keeps, or a folder): per kill, the moment the supervisor
detected the primary's exit, the new primary's "promoted" line (its promotion done, its answer about
to go), the supervisor's "is primary" line (the router told) and the continuation batch's head at
the new primary (its log line's time less "the last member to the core at +X ms after its head").
Log lines have millisecond stamps: so do these figures.

    python bench/probes/failover_hops.py LOGS.tgz|DIR [...]
"""
from __future__ import annotations

import re
import statistics
import sys
import tarfile
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
PRIMARY = re.compile(r" INFO (\w+) is primary \(epoch (\d+), (\w+), ([\d.]+) ms after detection\)")
PROMOTED = re.compile(r" (\w+) INFO engines\.engine: promoted: KV writer at pool epoch (\d+)")
BATCH = re.compile(r" (\w+) INFO engines\.continuation_batch: batch \w+: .* the last member to the core at "
                   r"\+([\d.]+) ms after its head")


def seconds(line: str) -> float | None:
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def lines(source: Path) -> dict[str, list[str]]:
    """Each log file's lines, by file name."""
    if source.is_dir():
        return {p.name: p.read_text(errors="replace").splitlines() for p in source.glob("*.log")}
    with tarfile.open(source) as tar:
        return {Path(m.name).name: tar.extractfile(m).read().decode(errors="replace").splitlines()
                for m in tar.getmembers() if m.isfile() and m.name.endswith(".log")}


def hops(logs: dict[str, list[str]]) -> list[dict[str, float]]:
    """Per failover (epoch > 1): ms from detection to the engine's promoted line, from there to "is
    primary", and from "is primary" to the batch's head (when a batch followed within 1 s)."""
    promoted: dict[int, float] = {}
    batches: list[tuple[str, float]] = []
    for name, text in logs.items():
        for line in text:
            if (m := PROMOTED.search(line)) and (t := seconds(line)) is not None:
                promoted[int(m.group(2))] = t
            elif (m := BATCH.search(line)) and (t := seconds(line)) is not None:
                batches.append((m.group(1), t - float(m.group(2)) / 1e3))
    out = []
    for line in logs.get("supervisor.log", []):
        m = PRIMARY.search(line)
        if not m or m.group(3) == "boot" or (t := seconds(line)) is None or int(m.group(2)) not in promoted:
            continue
        detected, engine = t - float(m.group(4)) / 1e3, m.group(1)
        at = promoted[int(m.group(2))]
        row = {"detected->promoted": at - detected, "promoted->primary": t - at}
        heads = [h for e, h in batches if e == engine and t - 0.05 <= h <= t + 1.0]
        if heads:
            row["primary->batch head"] = min(heads) - t
            row["detected->batch head"] = min(heads) - detected
        out.append({k: v * 1e3 for k, v in row.items()})
    return out


def main() -> None:
    for arg in sys.argv[1:]:
        rows = hops(lines(Path(arg)))
        parts = []
        for key in ("detected->promoted", "promoted->primary", "primary->batch head", "detected->batch head"):
            xs = [r[key] for r in rows if key in r]
            if xs:
                parts.append(f"{key} median {statistics.median(xs):.1f} ms, max {max(xs):.1f} (n={len(xs)})")
        print(f"{arg}: " + "; ".join(parts))
        for r in rows:
            print("   ", ", ".join(f"{k} {v:.0f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
