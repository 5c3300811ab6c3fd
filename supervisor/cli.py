"""`understudy`: the console script. Subcommands that belong to other packages are imported lazily,
so `understudy status` stays fast (no torch import); `chaos` and `bench` run the drivers of harness/,
which the product never imports."""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from importlib import import_module

from supervisor.arg_types import bounded_int

DELEGATED = {
    "chaos": "harness.chaos.cli",
    "make-model": "models.make_model",
    "daemon": "daemon.cli",
}
BENCH = {"attach": "harness.bench.weights", "load": "harness.bench.weights", "decode": "harness.bench.engine",
         "restart": "harness.bench.engine", "validate": "harness.bench.engine", "failover": "harness.bench.failover",
         "serve": "harness.bench.serve", "supervisor-restart": "harness.bench.readopt",
         "determinism": "harness.bench.determinism", "kv-digest": "harness.bench.kv_digest"}
WHOLE_ARGV = ("harness.bench.weights", "harness.bench.engine")  # their own subcommands: `attach`, `decode`...
EXIT_READER_GONE = 128 + 13  # the shell's status of a writer ended by SIGPIPE (`git log | head -1`)


def tool_parser(name: str) -> argparse.ArgumentParser:
    """The parser that reads the arguments of `name`, a subcommand handed to another module (`chaos`,
    `make-model`, `daemon`, `bench NAME`): that module is imported now."""
    cmd, _, bench = name.partition(" ")
    if cmd != "bench":
        return import_module(DELEGATED[cmd]).build_parser()
    p = import_module(BENCH[bench]).build_parser()
    if BENCH[bench] not in WHOLE_ARGV:
        return p
    (action,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices[bench]


def bench_parser() -> argparse.ArgumentParser:
    """`understudy bench -h`: every benchmark with its own description line."""
    p = argparse.ArgumentParser(prog="understudy bench", description="Benchmarks, each with arguments of its own "
                                "(`understudy bench NAME -h`).")
    sub = p.add_subparsers(metavar="NAME", required=True)
    for name in BENCH:
        sub.add_parser(name, help=tool_parser(f"bench {name}").description, add_help=False)
    return p


def _delegate(module: str, argv: list[str]) -> int:
    try:
        mod = import_module(module)
    except ModuleNotFoundError as e:
        print(f"understudy: {module} is not available ({e})", file=sys.stderr)
        return 2
    rc = mod.main(argv)
    return int(rc or 0)


def printing(command: Callable[[], int]) -> int:
    """Run a command that prints to stdout; a reader that left early (`understudy status | head -1`)
    ends it quietly with EXIT_READER_GONE instead of a BrokenPipeError traceback."""
    try:
        rc = command()
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is left in the buffer goes there at exit
        os.close(devnull)
        return EXIT_READER_GONE


port_number = bounded_int(0, 65535, "a port number (0-65535)")  # --port/--admin-port (0: any free port)


ADMIN_COMMANDS = {  # name -> what it does: its line in `understudy -h` and its description
    "status": "show engines, roles, states, daemons, weight source, epoch and recent failovers",
    "promote": "planned switchover: the READY standby becomes primary",
    "drain": "/readyz answers 503 so the load balancer stops sending traffic; "
             "requests that still arrive are served (none refused)",
    "undrain": "undo drain: /readyz answers 200 again",
    "rollout": "restart every engine in turn (standbys first, then a switchover), zero failed requests",
    "restart": "restart one engine (resets FATAL); the primary hands over to the standby first",
    "token": "print the admin token (e.g. curl -H \"authorization: Bearer $(understudy token)\")",
}
DELEGATED_HELP = {
    "chaos": "fault injection under load with an SLO report (see `understudy chaos -h`)",
    "bench": "benchmarks: " + " | ".join(BENCH),
    "make-model": "write a random HF checkpoint (DIR --preset NAME [--quant fp8-block|fp8-tensor])",
    "daemon": "run one rank's weight cache daemon in the foreground",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudy", description="Failover layer for LLM inference servers.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    what = "run the supervisor in the foreground (systemd Type=notify): daemons, a primary and a standby, the router"
    s = sub.add_parser("serve", help=what, description=what)
    s.add_argument("-c", "--config", help="YAML config (default: the embedded default)")
    s.add_argument("--port", type=port_number, metavar="N", help="data-plane port, over router.port (0: any free port)")
    s.add_argument("--admin-port", type=port_number, metavar="M",
                   help="admin API and status page port, over admin.port (0: any free port)")
    s.add_argument("--check", action="store_true",
                   help="run every check serve makes before starting anything (config, ports given, model folder, "
                        "device, KV budget, runtime dir) and exit: 0 if serve would start, 2 naming the key if not")
    for name, help_ in ADMIN_COMMANDS.items():
        a = sub.add_parser(name, help=help_, description=help_)
        a.add_argument("-c", "--config", help="the config the supervisor runs with (admin URL, token)")
        a.add_argument("--json", action="store_true", help="print {admin_url, token} as JSON" if name == "token"
                       else "print the raw JSON reply")
        if name == "restart":
            a.add_argument("engine", help="the engine's name, as `understudy status` lists it (e.g. a or b)")
            a.add_argument("--force", action="store_true", help="restart the primary even without a READY standby")
    for name, help_ in DELEGATED_HELP.items():  # parsed by their own modules (main below)
        sub.add_parser(name, help=help_, description=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(DELEGATED[argv[0]], argv[1:])
    if argv and argv[0] == "bench":
        if argv[1:] in (["-h"], ["--help"]):
            bench_parser().print_help()
            return 0
        if len(argv) < 2 or argv[1] not in BENCH:
            print(f"usage: understudy bench {{{'|'.join(BENCH)}}} ... (-h: what each does)", file=sys.stderr)
            return 2
        return _delegate(BENCH[argv[1]], argv[1:] if BENCH[argv[1]] in WHOLE_ARGV else argv[2:])
    ns = build_parser().parse_args(argv)
    if ns.cmd == "serve":
        from supervisor.serve import check_only, serve
        return (check_only if ns.check else serve)(ns.config, ns.port, ns.admin_port)
    return printing(lambda: _admin_command(ns))


def _admin_command(ns: argparse.Namespace) -> int:
    """`understudy status|promote|drain|undrain|restart|rollout|token`."""
    from supervisor.admin.client import run_command
    if ns.cmd == "token":
        from supervisor.admin.client import print_token
        return print_token(ns.config, ns.json)
    if ns.cmd == "status":
        return run_command(ns.config, "GET", "/status", ns.json)
    paths = {"promote": "/admin/promote", "drain": "/admin/drain", "undrain": "/admin/undrain",
             "rollout": "/admin/rollout"}
    if ns.cmd == "restart":
        from supervisor.config import ENGINE_NAME
        if not re.fullmatch(ENGINE_NAME, ns.engine):  # (it goes into the path: never a way around --force)
            print(f"understudy: restart: {ns.engine[:40]!r} is not an engine name (1-32 letters, digits, '_', '.', "
                  "'-'; `understudy status` lists them)", file=sys.stderr)
            return 2
        return run_command(ns.config, "POST", f"/admin/engines/{ns.engine}/restart" + ("?force=true" if ns.force else ""),
                           ns.json)
    return run_command(ns.config, "POST", paths[ns.cmd], ns.json, timeout_s=3600.0 if ns.cmd == "rollout" else 60.0)


if __name__ == "__main__":
    sys.exit(main())
