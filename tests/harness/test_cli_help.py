"""`understudy -h` and the README say the same thing: every subcommand has a description line and
help for every argument, and the README's command lists are checked against the parser (issue 24).
The chaos, bench, make-model and daemon subcommands parse their own arguments (their modules'
parsers: supervisor.cli.tool_parser)."""
from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys

import pytest

from supervisor.cli import ADMIN_COMMANDS, BENCH, DELEGATED, bench_parser, build_parser, tool_parser
from harness import ROOT

README = (ROOT / "README.md").read_text()


def subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def own_commands() -> list[str]:
    """The subcommands whose arguments this parser owns (not handed to another module's parser)."""
    return [name for name in subparsers() if name not in DELEGATED and name != "bench"]


@pytest.mark.parametrize("name", own_commands())
def test_every_command_says_what_it_does_and_every_argument_has_help(name):
    p = subparsers()[name]
    assert p.description and len(p.description) > 15, f"`understudy {name} -h` has no description line"
    for a in p._actions:
        if not isinstance(a, argparse._HelpAction):
            assert a.help and a.help != argparse.SUPPRESS, f"understudy {name}: {a.dest} has no help"


TOOLS = [*(f"bench {name}" for name in BENCH), "chaos"]  # the README's 'Benchmarks and chaos' block


@pytest.mark.parametrize("name", [*TOOLS, *(name for name in DELEGATED if name != "chaos")])
def test_every_delegated_command_says_what_it_does_and_every_argument_has_help(name):
    p = tool_parser(name)
    assert p.prog == f"understudy {name}"
    d = p.description or ""
    assert len(d) > 15 and "\n" not in d and d.endswith("."), f"`understudy {name} -h`: no description line: {d!r}"
    for a in p._actions:
        if not isinstance(a, argparse._HelpAction):
            assert a.help and a.help != argparse.SUPPRESS, f"understudy {name}: {a.dest} has no help"


def readme_tool_lines() -> list[tuple[str, str, str]]:
    """(command, example, comment) per line of the README's 'Benchmarks and chaos' block."""
    block = README[README.index("## Benchmarks and chaos"):]
    out = []
    for line in re.findall(r"^    understudy (.+)$", block, re.M):
        example, _, comment = line.partition("#")
        words = example.split()
        name = " ".join(words[:2]) if words[0] == "bench" else words[0]
        out.append((name, example.removeprefix(name), comment))
    return out


def test_the_readme_benchmarks_block_is_one_line_per_bench_and_chaos_in_the_cli_order():
    assert [name for name, _, _ in readme_tool_lines()] == TOOLS


@pytest.mark.parametrize("name, example, comment", readme_tool_lines())
def test_every_readme_benchmark_example_parses_and_names_only_real_options(name, example, comment):
    assert_parses(name, example, comment)


def test_the_readme_make_model_example_parses_and_names_only_real_options():
    (example,) = re.findall(r"`understudy make-model ([^`]+)`", README)
    assert_parses("make-model", example)


def assert_parses(name: str, example: str, comment: str = "") -> None:
    """`understudy NAME EXAMPLE` parses with its `[...]` parts given, once per alternative of each
    `a|b`; every option the example or its comment names exists."""
    p = tool_parser(name)
    words = example.replace("[", " ").replace("]", " ").split()
    for argv in itertools.product(*(w.split("|") for w in words)):  # chat|nano: each of them
        try:
            p.parse_args(list(argv))
        except SystemExit:
            pytest.fail(f"README: `understudy {name} {' '.join(argv)}` does not parse (see stderr)")
    known = {s for a in p._actions for s in a.option_strings}
    for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", example + comment):
        assert flag in known, f"README: `understudy {name}` has no option {flag}"


def test_the_help_is_printed_by_the_real_console_script():
    out = subprocess.run([sys.executable, "-m", "supervisor", "restart", "-h"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0
    assert ADMIN_COMMANDS["restart"] in " ".join(out.stdout.split())
    assert re.search(r"^  engine +the engine's name", out.stdout, re.M), out.stdout


@pytest.mark.parametrize("name", ["bench decode", "bench supervisor-restart", "chaos"])
def test_bench_and_chaos_help_comes_through_the_console_script(name):
    """`understudy bench decode` hands its module the whole argv, `bench supervisor-restart` the rest."""
    out = subprocess.run([sys.executable, "-m", "supervisor", *name.split(), "-h"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: understudy {name} ")
    assert tool_parser(name).description in " ".join(out.stdout.split())


def test_bench_help_lists_every_bench_with_its_description():
    out = subprocess.run([sys.executable, "-m", "supervisor", "bench", "-h"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert text.startswith("usage: understudy bench ") and bench_parser().description in text
    for name in BENCH:
        assert f"{name} {tool_parser(f'bench {name}').description}" in text


def test_every_command_is_in_the_readme():
    for name in subparsers():
        assert f"understudy {name}" in README, f"README.md never mentions `understudy {name}`"


def test_the_readme_admin_examples_are_exactly_the_admin_commands():
    block = README[README.index("## Using it"):README.index("With a config file")]
    shown = re.findall(r"^    \.venv/bin/understudy ([\w-]+)", block, re.M)
    assert sorted(shown) == sorted(ADMIN_COMMANDS), "README 'Using it' lists one line per admin command"


def test_the_readme_bench_list_is_the_cli_list():
    (listed,) = re.findall(r"`understudy bench ([\w-]+(?:\|[\w-]+)+)`", README)
    assert listed.split("|") == list(BENCH)


def test_the_readme_first_example_picks_the_ports():
    first = README[README.index("## The two commands"):README.index("## Using it")]
    assert "./scripts/serve --port 9000 --admin-port 9001" in first


@pytest.mark.parametrize("args, message", [
    (["bench", "attach", "--tensors", "0"], "argument --tensors: expected an integer >= 1, got 0"),
    (["bench", "attach", "--total-mb", "-1"], "argument --total-mb: expected a finite number > 0, got -1"),
    (["bench", "determinism", "--clients", "0"], "argument --clients: expected an integer >= 1, got 0"),
])
def test_bench_counts_and_sizes_are_refused_by_their_option(args, message):
    r = subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
