"""The gap across a kill beside the same run's gap at quiet moments, for every failover run kept.

`understudy bench failover --streams N` measures, per stream, its longest wait for tokens in the 1 s
from each kill ("across a kill") and in a 1 s window of the same run with no kill, ending by the kill
("quiet"). A failover that cost nothing would leave the first distribution equal to the second, so no
failover can bring the p99 across a kill below the quiet p99 of the same load. This lists both per
run, what the kill added to each stream in flight through both windows (where the report has it), and
the first token after the kill (the failover's own delay, from the router's events).

    python bench/probes/quiet_floor.py RUN.json|LOGS.tgz [...]   # failover_streams.json, or a .tgz holding one
"""
from __future__ import annotations

import json
import sys
import tarfile

from harness.stats import tail_text


def runs(path: str) -> list[dict]:
    """The failover reports (one per node) in a failover_streams.json or in the .tgz that holds one."""
    if path.endswith(".json"):
        return json.load(open(path))
    with tarfile.open(path) as tar:
        return [r for m in tar.getmembers() if m.name.endswith("failover_streams.json")
                for r in json.load(tar.extractfile(m))]


def row(path: str, r: dict, target_ms: float) -> str:
    q = r.get("gap_at_quiet_moments_ms", {})  # (older reports had no quiet figure, none what a kill added)
    pair = lambda s: f"{s['p50']} / {tail_text(s, '', '.2f').strip()}" if s.get("n") else "-"  # noqa: E731
    floor = "-" if q.get("p99") is None else ("below the quiet p99" if q["p99"] > target_ms else "above it")
    return (f"| {path} | {r['shared_kv']} | {r['streams']} | {r['kills']} | {pair(r['gap_across_kill_ms'])} | "
            f"{pair(q)} | {pair(r.get('gap_added_by_kill_ms', {}))} | "
            f"{pair(r.get('continuation_timeline_ms', {}).get('token', {}))} | {floor} |")


def main(paths: list[str], target_ms: float = 30.0) -> None:
    print(f"| run | shared_kv | streams | kills | across a kill: p50 / tail ms | quiet: p50 / tail ms | "
          f"added by the kill: p50 / tail ms | "
          f"first token after the kill: p50 / tail ms | a {target_ms:g} ms p99 target is |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        for r in runs(path):
            print(row(path, r, target_ms))


if __name__ == "__main__":
    main(sys.argv[1:])
