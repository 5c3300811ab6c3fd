"""deploy/ against one real `understudy serve` (CPU, tiny model): every metric the Grafana dashboard
queries is in a real /metrics scrape, with every label the dashboard matches on or groups by, and the
k8s preStop script drains the node and returns, bounded."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness import ROOT

from harness.node import running

DASHBOARD = ROOT / "deploy" / "grafana" / "understudy.json"
CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}}
failover: {{backoff_base_s: 0.1, drain_timeout_s: 10, stop_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""
# PromQL words that look like names but are not metrics; a name followed by "(" is a function.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "atan2", "inf", "nan"}
TARGET_LABELS = {"instance", "job"}  # Prometheus adds them to every series it scrapes


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (strings, label matchers, ranges, label lists, dashboard
    variables and function names stripped; ``label_values(metric, label)`` gives ``metric``)."""
    names = set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,", expr))
    s = re.sub(r"label_values\([^)]*\)", " ", expr)
    s = re.sub(r'"(?:[^"\\]|\\.)*"', " ", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def label_uses(expr: str) -> dict[str, set[str]]:
    """Metric name -> the labels ``expr`` reads on it: those of its selector's matchers, and those of every
    ``by|without|on|ignoring (...)`` list in ``expr`` (applied to each metric the expression reads)."""
    grouped = set()
    for labels in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        grouped |= {x.strip() for x in labels.split(",") if x.strip()}
    uses = {name: set(grouped) for name in metric_names(expr)}
    for name, label in re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(\w+)\s*\)", expr):
        uses[name].add(label)
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", s):
        uses.setdefault(name, set(grouped)).update(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    return uses


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if var["type"] == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    exprs.extend(a["expr"] for a in dash["annotations"]["list"] if a.get("expr"))
    return exprs


def exported_names(scrape: str) -> set[str]:
    """Every series name a scrape declares: counters as ``_total``, histograms as ``_bucket/_sum/_count``
    (a labelled family with no child yet is declared by its TYPE line, so it counts)."""
    names = set()
    for fam in text_string_to_metric_families(scrape):
        names |= {s.name for s in fam.samples}
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names |= {fam.name + sfx for sfx in ("_bucket", "_sum", "_count")}
        else:
            names.add(fam.name)
    return names


def test_metric_names_are_parsed_out_of_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le, phase) (rate(understudy_x_bucket{a="b",c=~"$v"}[$window])))') \
        == {"understudy_x_bucket"}
    assert metric_names("sum(increase(a_total[5m])) / sum(increase(b_total{result=\"hit\"}[$__range])) or vector(0)") \
        == {"a_total", "b_total"}
    assert metric_names("count(up == 0) and on (instance) changes(x[1m]) > 0") == {"up", "x"}
    assert metric_names("label_values(understudy_epoch, instance)") == {"understudy_epoch"}


def test_label_uses_are_parsed_out_of_promql():
    assert label_uses('histogram_quantile(0.99, sum by (le, phase) (rate(x_bucket{a="b",c=~"$v"}[5m])))') == \
        {"x_bucket": {"le", "phase", "a", "c"}}
    assert label_uses('sum(increase(a_total{result="hit", code!~"5.."}[5m])) / sum(increase(b_total[5m]))') == \
        {"a_total": {"result", "code"}, "b_total": set()}
    assert label_uses('x{instance=~"$instance"} == 1') == {"x": {"instance"}}
    assert label_uses('up{job="a={b}"}') == {"up": {"job"}}
    assert label_uses("label_values(understudy_epoch, instance)") == {"understudy_epoch": {"instance"}}


def scraped_labels(scrape: str) -> dict[str, set[str]]:
    """Series name -> the label names its samples carry in a scrape."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(scrape):
        for sample in fam.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def label_problems(exprs: list[str], scraped: dict[str, set[str]]) -> list[str]:
    """Each label an expression reads that its metric lacks in the scrape (target labels aside)."""
    wrong = []
    for expr in exprs:
        for name, labels in label_uses(expr).items():
            needed = labels - TARGET_LABELS
            if needed and name not in scraped:
                wrong.append(f"{name}: no sample in the scrape to check labels {sorted(needed)} on ({expr})")
            elif needed - scraped.get(name, set()):
                wrong.append(f"{name} has no label {sorted(needed - scraped[name])} (it has {sorted(scraped[name])}): {expr}")
    return wrong


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "understudy" and dash["title"]
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
    for topic in ("Failover time", "Recovery time", "hit rate", "Startup phase", "Responses by status",
                  "Held requests", "Standby READY", "Failovers by reason", "Output tokens/s",
                  "Time to first token", "Inter-token", "Stream gap across a failover"):
        assert any(topic in p["title"] for p in panels), topic


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("deploy")
    with running(work, CONFIG.format(rt=work / "rt", model=tiny_model), notify=False) as h:
        yield h


def test_every_metric_in_the_dashboard_is_in_a_real_scrape(node):
    r = httpx.post(node.router_url + "/v1/completions", json={"model": node.status()["model"]["name"], "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    scrape = node.metrics()
    exported = exported_names(scrape)
    used: set[str] = set()
    for expr in dashboard_queries():
        names = metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        used |= names
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics that /metrics does not export: {missing}"
    # and the figures the dashboard is for are really there (not only declared) on a serving node
    for series in ("understudy_active_engines", "understudy_standby_ready", "understudy_epoch",
                   "understudy_engine_startup_phase_seconds_bucket", "understudy_router_requests_total",
                   "understudy_weight_cache_requests_total", "understudy_daemon_resident_bytes"):
        assert re.search(rf"^{series}[{{ ]", scrape, re.M), series


def test_every_label_the_dashboard_reads_is_on_the_scraped_metric(node):
    # a failover and a request first, so that the labelled series the dashboard reads have samples
    since = len(node.events)
    os.kill(node.primary()["pid"], signal.SIGKILL)
    node.wait_event(lambda e: e["type"] == "failover", since=since)
    node.wait_all_ready()
    r = httpx.post(node.router_url + "/v1/completions", json={"model": node.status()["model"]["name"], "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    scraped = scraped_labels(node.metrics())
    wrong = label_problems(dashboard_queries(), scraped)
    assert not wrong, "\n".join(wrong)
    # and a panel with a wrong label would fail
    assert label_problems(['sum by (reason) (rate(understudy_router_requests_total{code="200"}[5m]))'], scraped) == [
        "understudy_router_requests_total has no label ['reason'] (it has ['code']): "
        'sum by (reason) (rate(understudy_router_requests_total{code="200"}[5m]))']


def prestop(node, tmp_path: Path, config: Path, lb: int, wait: int) -> tuple[int, str]:
    cm = yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text())
    script = tmp_path / "prestop-drain.sh"
    script.write_text(cm["data"]["prestop-drain.sh"])
    log = tmp_path / "prestop.log"
    log.write_text("")
    env = {**os.environ, "UNDERSTUDY_CONFIG": str(config), "PRESTOP_LOG": str(log),
           "DRAIN_LB_SECONDS": str(lb), "DRAIN_WAIT_SECONDS": str(wait),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # `understudy` and python3 of this venv
    rc = subprocess.run(["/bin/sh", str(script)], env=env, timeout=wait + 60).returncode
    return rc, log.read_text()


def test_prestop_with_a_wrong_token_says_so_and_gives_up_at_its_deadline(node, tmp_path):
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token\n")
    wrong.chmod(0o600)
    cfg = tmp_path / "understudy.yaml"
    text = node.config.read_text()
    assert "admin: {port: 0}" in text
    cfg.write_text(text.replace("admin: {port: 0}", f"admin: {{port: 0, token_file: {wrong}}}"))
    rc, log = prestop(node, tmp_path, cfg, lb=0, wait=2)
    assert rc == 1 and "drain failed" in log and "HTTP 401" in log and "gave up after 2s" in log, log
    assert node.status()["drained"] is False


def test_prestop_drains_the_node_and_returns_once_nothing_is_in_flight(node, tmp_path):
    assert httpx.get(node.router_url + "/readyz").status_code == 200
    rc, log = prestop(node, tmp_path, node.config, lb=1, wait=30)
    assert rc == 0 and "node drained, no request in flight" in log, log  # (not "gave up": it did not wait 30 s)
    assert node.status()["drained"] is True
    rz = httpx.get(node.router_url + "/readyz")
    assert rz.status_code == 503 and rz.json()["reason"] == "node is drained"
    r = httpx.post(node.router_url + "/v1/completions", json={"model": node.status()["model"]["name"], "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200  # drained means "moved away from", not "refusing"
    assert node.admin("POST", "/admin/undrain").status_code == 200
