"""Write the report folder: report.json, report.md, latency.png and raw.jsonl."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .analysis import RunData
from .report_md import render
from .schema import ChaosReport

PNG = "latency.png"


def write_report(out_dir: Path, report: ChaosReport, data: RunData) -> list[str]:
    """Write every file; a failing plot is noted in report.md instead of losing the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png: str | None = PNG
    try:
        from .plot import plot_latency  # (matplotlib: the `harness` extra; without it, no picture)
        plot_latency(out_dir / PNG, data.t0, data.requests, data.faults, data.events)
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        report.notes.append(f"plot not written: {type(exc).__name__}: {exc}")
        png = None
    (out_dir / "report.json").write_text(report.model_dump_json(indent=2) + "\n")
    (out_dir / "report.md").write_text(render(report, png))
    with (out_dir / "raw.jsonl").open("w") as fh:
        for r in data.requests:
            fh.write(json.dumps({"request": asdict(r)}) + "\n")
        for f in data.faults:
            fh.write(json.dumps({"fault": asdict(f)}) + "\n")
        for e in data.events:
            fh.write(json.dumps({"event": e.model_dump(by_alias=True)}) + "\n")
    return [name for name in ("report.json", "report.md", png, "raw.jsonl") if name]
