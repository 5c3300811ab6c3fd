"""Where the time to first token goes, hop by hop, while a command runs against a node.

    python3 bench/probes/ttft_split.py ENGINE_URL [-c CONFIG] -- COMMAND...

Scrapes the engine's /metrics (and, with -c, the supervisor's through its admin API) before and
after COMMAND and prints, for each first-output histogram, the requests counted, the mean and the
p50 (bucket upper bound) over the run: the router's request -> first token back
(supervisor/metrics.py), the engine front end's ingress (HTTP call -> handed to the core), and the
engine's own parts (engines/frontend/first_output.py). The client's TTFT minus the router's figure is the
client <-> router hop; the router's minus the engine's ingress and front-end figures is the
router <-> engine hop and both HTTP loops."""
from __future__ import annotations

import math
import subprocess
import sys

import httpx

from harness.prometheus import Histogram, MetricsSnapshot

ROUTER_PARTS = ("understudy_router_first_token_seconds",)
ENGINE_PARTS = ("understudy_engine_ingress_seconds", "understudy_engine_queue_seconds",
                "understudy_engine_core_first_output_seconds", "understudy_engine_first_output_seconds")


def histograms(text: str, parts: tuple[str, ...]) -> dict[str, Histogram]:
    """The histograms `parts` of a Prometheus text (harness/prometheus.py reads it)."""
    snap = MetricsSnapshot.parse(text)
    return {p: snap.histogram(p) for p in parts}


def scrape(engine_url: str, config: str | None) -> dict[str, Histogram]:
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
    for part, a in after.items():
        h = a.minus(before[part]) if part in before else a
        mean, p50 = h.mean, h.bucket_of(0.5)  # p50: the upper bound of its bucket
        print(f"{part:46}{h.count:>7.0f}{math.nan if mean is None else mean * 1e3:>10.2f}"
              f"{math.nan if p50 is None else p50[1] * 1e3:>11.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
