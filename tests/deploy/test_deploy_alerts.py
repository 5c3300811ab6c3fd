"""deploy/prometheus/understudy-alerts.yaml (issue 52, item 8): valid for Prometheus's own checker,
each alert firing where its unit test says (promtool, from Debian's `prometheus` package, installed by
scripts/install), and every series it reads one the supervisor exports."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from supervisor.metrics import Metrics

DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = DIR / "understudy-alerts.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: scripts/install installs Debian's prometheus package as root "
                    "(apt-get install prometheus)")
    return subprocess.run([tool, *args], cwd=DIR, capture_output=True, text=True, timeout=60)


def test_the_rules_pass_promtools_check_and_their_unit_tests() -> None:
    r = promtool("check", "rules", RULES.name)
    assert r.returncode == 0 and "SUCCESS: 6 rules found" in r.stdout, r.stdout + r.stderr
    r = promtool("test", "rules", "understudy-alerts.test.yaml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_series_the_rules_read_is_one_the_supervisor_exports() -> None:
    exported = generate_latest(Metrics().registry).decode()
    names = {line.split("{")[0].split(" ")[0] for line in exported.splitlines() if line and not line.startswith("#")}
    names |= {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", exported, re.M)}  # (labelled: no sample yet)
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"UnderstudyNoPrimary", "UnderstudySeveralPrimaries", "UnderstudyNoStandby",
                                           "UnderstudyEngineFatal", "UnderstudyWeightCacheMisses",
                                           "UnderstudyRecoverySlow"}
    for rule in rules:
        for series in set(re.findall(r"understudy_[a-z_]+", rule["expr"])):
            base = re.sub(r"_(bucket|count|sum|total)$", "", series)
            assert series in names or base in names, f"{rule['alert']} reads {series}, which /metrics does not export"
        for series, le in re.findall(r'(understudy_[a-z_]+_bucket)\{le="([^"]+)"\}', rule["expr"]):
            assert f'{series}{{le="{le}"}}' in exported, f"{rule['alert']} reads a bucket le={le!r} /metrics does not have"
