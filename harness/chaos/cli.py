"""`understudy chaos ...`: argument parsing and the one-screen summary."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from .options import FAULT_KINDS, ChaosOptions, parse_counts, parse_weights
from .run import run_chaos
from .target import TargetError, resolve_target

EXIT_OK, EXIT_ABORTED, EXIT_USAGE, EXIT_CHECKS = 0, 1, 2, 3

#: (group, flag, ChaosOptions field, type, help); defaults come from ChaosOptions itself.
NUMERIC_FLAGS: list[tuple[str, str, str, type, str]] = [
    ("load", "--rate", "rate", float, "request arrivals per second"),
    ("load", "--concurrency", "concurrency", int, "max requests in flight; arrivals beyond it are counted, not sent"),
    ("load", "--stream-fraction", "stream_fraction", float, "share of streaming requests"),
    ("load", "--max-tokens", "max_tokens", int, "tokens per request"),
    ("load", "--request-timeout", "request_timeout_s", float, "seconds per request"),
    ("faults", "--interval", "interval_s", float, "min seconds between two faults"),
    ("faults", "--warmup", "warmup_s", float, "seconds of load before the first fault"),
    ("faults", "--settle", "settle_s", float, "after the last fault, wait up to this for everything READY"),
    ("faults", "--ready-timeout", "ready_timeout_s", float, "before a fault, wait up to this for everything READY"),
    ("faults", "--stop-release", "stop_release_s", float, "SIGCONT a SIGSTOPped group left alone this long"),
    ("faults", "--idle-connections", "idle_connections", int, "idle-connections fault: connections opened"),
    ("faults", "--idle-hold", "idle_hold_s", float, "idle-connections fault: held this long (s)"),
    ("faults", "--seed", "seed", int, "order of the faults, targets, request mix"),
    ("run", "--duration", "duration_s", float, "hard limit on the whole run, seconds"),
    ("run", "--dead-after", "dead_after_s", float, "abort when the admin API fails this long"),
    ("run", "--failover-window", "failover_window_s", float, "seconds after a fault counted as 'around' it"),
    ("run", "--tolerance", "tolerance", float, "honest-metrics agreement, relative"),
    ("run", "--tolerance-floor", "tolerance_floor_s", float, "honest-metrics agreement of time figures, absolute s"),
    ("run", "--slo-failover-p99", "slo_failover_p99_s", float, "check: failover p99 <= this many seconds"),
    ("run", "--slo-recovery-p99", "slo_recovery_p99_s", float, "check: engine recovery p99 <= this many seconds"),
    ("run", "--max-memory-growth", "max_memory_growth_pct", float, "check: process-tree memory growth, percent"),
]


def build_parser() -> argparse.ArgumentParser:
    """All options; numeric defaults are ChaosOptions' own."""
    p = argparse.ArgumentParser(
        prog="understudy chaos",
        description="Kill engines under load and report every failover (loopback only; stops by itself).",
    )
    t = p.add_argument_group("target (flags win over the config)")
    t.add_argument("-c", "--config", help="the supervisor's config (default: its embedded default)")
    t.add_argument("--data-url", help="data plane, e.g. http://127.0.0.1:8000")
    t.add_argument("--admin-url", help="admin API, e.g. http://127.0.0.1:8001")
    t.add_argument("--token-file", help="admin bearer token file")
    t.add_argument("--events", help="events PUB endpoint (default: the one GET /status names)")
    t.add_argument("--supervisor-pid", type=int, help="for RSS (default: from /status)")
    groups = {"load": p.add_argument_group("load"), "faults": p.add_argument_group("faults"),
              "run": p.add_argument_group("run and report")}
    groups["load"].add_argument("--mix", default="completion:1,chat:1", help="endpoint weights (%(default)s)")
    groups["faults"].add_argument("--faults", default="kill-primary:3",
                                  help=f"KIND:COUNT,... (%(default)s), shuffled; kinds: {', '.join(FAULT_KINDS)}")
    for group, flag, field, typ, help_ in NUMERIC_FLAGS:
        default = ChaosOptions.model_fields[field].default
        groups[group].add_argument(flag, dest=field, type=typ, default=default, metavar=typ.__name__.upper(),
                                   help=help_ + ("" if default is None else " (%(default)s)"))
    groups["run"].add_argument("--out", help="report folder (default ./chaos-YYYYmmdd-HHMMSS)")
    groups["run"].add_argument("--strict", action="store_true", help=f"exit {EXIT_CHECKS} if any check fails")
    return p


def options_from_args(args: argparse.Namespace) -> ChaosOptions:
    """Resolve the target and validate everything; TargetError/ValueError on bad input."""
    target = resolve_target(args.config, args.data_url, args.admin_url, args.token_file, args.events)
    return ChaosOptions(
        data_url=target.data_url, admin_url=target.admin_url, token=target.token,
        events_endpoint=target.events_endpoint, supervisor_pid=args.supervisor_pid,
        out_dir=args.out or time.strftime("chaos-%Y%m%d-%H%M%S"),
        mix=parse_weights(args.mix, "--mix"), faults=parse_counts(args.faults, "--faults"),
        **{field: getattr(args, field) for _, _, field, _, _ in NUMERIC_FLAGS},
    )


def _validation_line(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(str(x) for x in e['loc']) or 'options'}: {e['msg']}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `understudy chaos`; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        opts = options_from_args(args)
    except ValidationError as exc:
        print(f"understudy chaos: {_validation_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (TargetError, ValueError) as exc:
        print(f"understudy chaos: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"understudy chaos: cannot create the report folder {opts.out_dir}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    plan = opts.fault_plan()
    print(f"chaos: {len(plan)} faults, {opts.rate:g} req/s against {opts.data_url} "
          f"(at most {opts.duration_s:g} s); report in {opts.out_dir}/", flush=True)
    report, files = asyncio.run(run_chaos(opts))
    if report.aborted:
        print(f"understudy chaos: aborted: {report.aborted} (partial report written)", file=sys.stderr)
    for c in report.checks:
        print(f"  {'PASS' if c.ok else 'FAIL'} {c.name}: {c.detail}")
    print(f"report: {', '.join(f'{opts.out_dir}/{f}' for f in files)}")
    if report.aborted:
        return EXIT_ABORTED
    if args.strict and not all(c.ok for c in report.checks):
        return EXIT_CHECKS
    return EXIT_OK
