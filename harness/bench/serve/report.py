"""The report: one JSON document, a PNG (throughput and latency against concurrency), a table."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from harness.stats import P99_MIN_N

from .stats import Point


class Report(BaseModel):
    bench: str = "serve"
    mode: str  # "live" (an HTTP endpoint) or "offline" (in-process engine)
    workload: str
    input_len: str
    output_len: str
    prefix_len: int
    url: str | None
    model: str
    max_model_len: int | None
    requests_per_point: int | None
    temperature: float
    ignore_eos: bool
    started: str
    points: list[Point]
    static: dict[str, Any] | None = None  # harness.bench.engine decode's result, or {"skipped": why}
    notes: list[str] = []
    total_errors: int = 0


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def table(r: Report) -> str:
    head = (f"{'conc':>5}{'ok':>6}{'err':>5}{'out tok/s':>11}{'req/s':>8}{'TTFT p50':>10}{'p99':>9}"
            f"{'ITL p50':>9}{'p99':>8}{'static':>10}{'ratio':>7}{'prefix hit':>11}")
    lines = [f"bench serve: {r.workload} ({r.mode}), {r.model}, input {r.input_len}"
             f"{f' + {r.prefix_len} shared' if r.prefix_len else ''}, output {r.output_len} tokens"
             f"{', ignore_eos' if r.ignore_eos else ''}; times in ms", head]
    for p in r.points:
        hit = p.prefix_cache if isinstance(p.prefix_cache, str) else _f(p.prefix_cache.hit_rate, ".1%")
        lines.append(
            f"{p.concurrency:>5}{p.ok:>6}{p.errors:>5}{p.output_tok_s:>11.1f}{p.req_s:>8.2f}"
            f"{_f(p.ttft_ms and p.ttft_ms.p50, '.2f'):>10}{p.ttft_ms.tail() if p.ttft_ms else '-':>9}"
            f"{_f(p.itl_ms and p.itl_ms.p50, '.2f'):>9}{p.itl_ms.tail() if p.itl_ms else '-':>8}"
            f"{_f(p.static_tok_s):>10}{_f(p.ratio_to_static, '.2f'):>7}{hit:>11}")
    for p in r.points:
        for e in p.error_samples:
            lines.append(f"  error at {p.concurrency}: {e}")
    for p in r.points:
        if p.itl_ms and p.itl_same_read:
            lines.append(f"  ITL at {p.concurrency}: {p.itl_same_read} of {p.itl_ms.count} gaps are 0 "
                         "(chunks that arrived in one read)")
    if any(d is not None and d.p99 is None for p in r.points for d in (p.ttft_ms, p.itl_ms)):
        lines.append(f"*: the max of fewer than {P99_MIN_N} values (no p99 of so few)")
    lines += [f"note: {n}" for n in r.notes]
    if r.static and "skipped" in r.static:
        lines.append(f"static decode: skipped ({r.static['skipped']})")
    return "\n".join(lines)


def write_png(r: Report, path: Path) -> None:
    """Left: output tok/s (and the static decode) against concurrency; right: TTFT and ITL."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = r.points
    conc = [p.concurrency for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(conc, [p.output_tok_s for p in pts], "o-", label="live output tok/s")
    st = [(p.concurrency, p.static_tok_s) for p in pts if p.static_tok_s is not None]
    if st:
        a.plot([c for c, _ in st], [s for _, s in st], "s--", label="static decode tok/s")
    a.set_xlabel("concurrency")
    a.set_ylabel("tokens/s")
    a.set_title(f"{r.workload}: throughput")
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms")):
        for q, style in (("p50", "o-"), ("p99", "^--")):
            xs = [(p.concurrency, v) for p in pts if (v := getattr(getattr(p, key), q, None)) is not None]
            if xs:
                b.plot([c for c, _ in xs], [v for _, v in xs], style, label=f"{name} {q}")
    b.set_xlabel("concurrency")
    b.set_ylabel("ms")
    b.set_title(f"{r.workload}: latency")
    for ax in (a, b):
        if len(set(conc)) > 1 and max(conc) / max(min(conc), 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    if b.lines and all(min(line.get_ydata()) > 0 for line in b.lines):
        b.set_yscale("log")
    fig.suptitle(f"understudy bench serve: {r.model} ({r.mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(r: Report, out_dir: Path) -> tuple[Path, Path | None]:
    """The JSON, and the picture where matplotlib is installed (the `harness` extra), else None."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, png = out_dir / "bench-serve.json", out_dir / "bench-serve.png"
    js.write_text(r.model_dump_json(indent=2) + "\n")
    try:
        write_png(r, png)
    except ModuleNotFoundError:
        return js, None
    return js, png
