"""`understudy -h` and the README say the same thing: every subcommand has a description line and
help for every argument, and the README's command lists are checked against the parser (issue 24).
The chaos and bench subcommands parse their own arguments (their modules' parsers)."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from supervisor.cli import ADMIN_COMMANDS, BENCH, DELEGATED, build_parser
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


def test_the_help_is_printed_by_the_real_console_script():
    out = subprocess.run([sys.executable, "-m", "supervisor", "restart", "-h"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0
    assert ADMIN_COMMANDS["restart"] in " ".join(out.stdout.split())
    assert re.search(r"^  engine +the engine's name", out.stdout, re.M), out.stdout


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
