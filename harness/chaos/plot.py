"""latency.png: request latency over time, with faults and role changes marked."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .events import Event, FailoverEvent, RecoveredEvent  # noqa: E402
from .records import FaultRecord, RequestRecord  # noqa: E402

TARGET_COLORS = {"primary": "tab:red", "standby": "tab:orange", "daemon": "tab:brown", "random": "tab:olive",
                 "promote": "tab:blue", "rollout": "tab:purple"}
ACTION_STYLES = {"kill": "-", "stop": "-."}
FULL_LINES_UP_TO = 30  # more faults than this: only the marker bands at the top, no full-height lines
BANDS = {"fault": (0.92, 1.0), "failover": (0.85, 0.91), "recovered": (0.78, 0.84)}


def _band(ax, xs: list[float], band: str, **style) -> None:
    """Short vertical ticks in a band at the top of the axes (x in data, y in axes units)."""
    if xs:
        lo, hi = BANDS[band]
        ax.vlines(xs, lo, hi, transform=ax.get_xaxis_transform(), **style)


def plot_latency(path: Path, t0: float, requests: Sequence[RequestRecord], faults: Sequence[FaultRecord],
                 events: Sequence[Event], max_points: int = 200_000) -> None:
    """Write the PNG; failures are crosses at their send time and time-to-failure."""
    fig, ax = plt.subplots(figsize=(14, 5), dpi=100)
    step = max(1, len(requests) // max_points)
    shown = requests[::step]
    for ok, stream, marker, color, label in (
        (True, False, ".", "tab:gray", "ok"),
        (True, True, ".", "tab:green", "ok, streaming"),
        (False, False, "x", "tab:red", "failed"),
        (False, True, "x", "tab:pink", "failed, streaming"),
    ):
        pts = [(r.t_start - t0, max(r.latency, 1e-4)) for r in shown if r.ok == ok and r.stream == stream]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, s=6 if ok else 24, marker=marker, color=color, label=f"{label} ({len(pts)})",
                       linewidths=1)
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * (hi / lo) ** 0.3)  # headroom: the marker bands sit above the points
    full = len(faults) <= FULL_LINES_UP_TO
    for kind in sorted({f.kind for f in faults}):
        action, _, role = kind.partition("-")
        color = TARGET_COLORS.get(role or action, "black")
        xs = [f.t - t0 for f in faults if f.kind == kind]
        _band(ax, xs, "fault", color=color, lw=1.2, label=f"{kind} ({len(xs)})")
        if full:
            ax.vlines(xs, 0, 1, transform=ax.get_xaxis_transform(), color=color,
                      linestyles=ACTION_STYLES.get(action, "-"), lw=0.6, alpha=0.5)
    _band(ax, [e.ts - t0 for e in events if isinstance(e, FailoverEvent)], "failover", color="tab:green", lw=1.2,
          label="failover: new primary")
    _band(ax, [e.ts - t0 for e in events if isinstance(e, RecoveredEvent)], "recovered", color="tab:cyan", lw=1.2,
          label="replacement READY")
    ax.set_xlabel("seconds since start (ticks at the top: faults, failovers, replacements READY)")
    ax.set_ylabel("request latency (s)")
    ax.set_title("Understudy chaos: latency, faults and role changes")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
