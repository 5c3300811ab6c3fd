"""Where the time to first token goes, hop by hop, while a command runs against a node.

    python3 bench/probes/ttft_split.py ENGINE_URL [-c CONFIG] -- COMMAND...

Scrapes the engine's /metrics (and, with -c, the supervisor's through its admin API) before and
after COMMAND and prints, for each first-output histogram, the requests counted, the mean and the
p50 (bucket upper bound) over the run: the router's request -> first token back
(supervisor/metrics.py), the engine front end's ingress (HTTP call -> handed to the core), and the
engine's own parts (engines/first_output.py). The client's TTFT minus the router's figure is the
client <-> router hop; the router's minus the engine's ingress and front-end figures is the
router <-> engine hop and both HTTP loops."""
from __future__ import annotations

import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROUTER_PARTS = ("understudy_router_first_token_seconds",)
ENGINE_PARTS = ("understudy_engine_ingress_seconds", "understudy_engine_queue_seconds",
                "understudy_engine_core_first_output_seconds", "understudy_engine_first_output_seconds")


def histograms(text: str, parts: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """{histogram: {'count': n, 'sum': s, le: cumulative count}} for `parts` in a Prometheus text."""
    out: dict[str, dict[str, float]] = {p: {} for p in parts}
    for fam in text_string_to_metric_families(text):
        h = out.get(fam.name) if fam.name in out else out.get(fam.name + "_seconds")
        if h is None:
            continue
        for s in fam.samples:
            key = s.labels["le"] if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]
            h[key] = s.value
    return out


def scrape(engine_url: str, config: str | None) -> dict[str, dict[str, float]]:
    out = histograms(httpx.get(engine_url + "/metrics", timeout=10).text, ENGINE_PARTS)
    if config is not None:
        from supervisor.admin.client import call
        status, text = call(config, "GET", "/metrics", timeout_s=10)
        if status == 200:
            out.update(histograms(text, ROUTER_PARTS))
    return out


def main() -> int:
    args, cmd = sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]
    url, config = args[0], (args[args.index("-c") + 1] if "-c" in args else None)
    before = scrape(url, config)
    rc = subprocess.call(cmd)
    after = scrape(url, config)
    print(f"{'part':46}{'n':>7}{'mean ms':>10}{'p50 <= ms':>11}")
    for part in after:
        a, b = after[part], before.get(part, {})
        n = a.get("count", 0) - b.get("count", 0)
        mean = (a.get("sum", 0) - b.get("sum", 0)) / n * 1e3 if n else float("nan")
        les = sorted((float(le), a[le] - b.get(le, 0)) for le in a if le not in ("count", "sum", "created"))
        p50 = next((le for le, c in les if c >= n / 2), float("nan")) * 1e3 if n else float("nan")
        print(f"{part:46}{n:>7.0f}{mean:>10.2f}{p50:>11.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
