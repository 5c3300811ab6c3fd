"""Where the time to first output goes inside the engine while a command runs against it.

    python3 bench/probes/ttft_split.py ENGINE_URL -- COMMAND...

Scrapes the engine's /metrics before and after COMMAND and prints, for each first-output
histogram (engines/first_output.py), the requests counted, the mean and the p50 (bucket upper
bound) over the run."""
from __future__ import annotations

import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

PARTS = ("understudy_engine_queue_seconds", "understudy_engine_core_first_output_seconds",
         "understudy_engine_first_output_seconds")


def scrape(url: str) -> dict[str, dict[str, float]]:
    """{histogram: {'count': n, 'sum': s, le: cumulative count}}"""
    out: dict[str, dict[str, float]] = {p: {} for p in PARTS}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name + "_seconds" in out or fam.name in out:
            h = out[fam.name] if fam.name in out else out[fam.name + "_seconds"]
            for s in fam.samples:
                key = s.labels["le"] if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]
                h[key] = s.value
    return out


def main() -> int:
    url, cmd = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    before = scrape(url)
    rc = subprocess.call(cmd)
    after = scrape(url)
    print(f"{'part':46}{'n':>7}{'mean ms':>10}{'p50 <= ms':>11}")
    for part in PARTS:
        a, b = after[part], before[part]
        n = a.get("count", 0) - b.get("count", 0)
        mean = (a.get("sum", 0) - b.get("sum", 0)) / n * 1e3 if n else float("nan")
        les = sorted((float(le), a[le] - b.get(le, 0)) for le in a if le not in ("count", "sum", "created"))
        p50 = next((le for le, c in les if c >= n / 2), float("nan")) * 1e3 if n else float("nan")
        print(f"{part:46}{n:>7.0f}{mean:>10.2f}{p50:>11.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
