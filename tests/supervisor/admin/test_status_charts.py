"""The status page's live charts (issue 24) in a real headless Chromium against one real supervisor
(CPU, tiny model) under load: every chart draws from /metrics, and a SIGKILLed primary appears on the
charts as one failover mark carrying its failover_seconds and the longest gap it caused in a stream
that was in flight (the router's migration event), without a reload."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from harness.load import Load

from harness.node import running
from tests.supervisor.router.test_migration_failover import Stream
from test_status_page import browser, login, page  # noqa: F401 (fixtures)

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}, name: m}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 512}}
failover: {{heartbeat_timeout_s: 2, probe_interval_s: 1, hold_timeout_s: 20, backoff_base_s: 0.1,
           backoff_max_s: 1, flap_max: 50, drain_timeout_s: 10, stop_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""
SERIES = {"tokens": ["tok"], "requests": ["req"], "ttft": ["ttft50", "ttft99"], "itl": ["step50", "step99"],
          "seqs": ["running", "waiting"], "kv": ["kv"]}
LONG = {"model": "m", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def continued_since(node, since: int, n: int, timeout_s: float = 30.0) -> list[dict]:
    """The first ``n`` continued-migration events after event ``since``, once the harness has them."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [e for e in node.events[since:] if e["type"] == "migration" and e["result"] == "continued"]
        if len(got) >= n or time.monotonic() > deadline:
            assert len(got) >= n, f"{len(got)} of {n} continued migrations seen: {node.events[since:]}"
            return got[:n]
        time.sleep(0.02)


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("charts")
    with running(work, CONFIG.format(rt=work / "rt", model=tiny_model), notify=False) as h:
        yield h


def test_charts_show_the_load_and_a_killed_primary_as_one_failover_mark(node, page):
    from playwright.sync_api import expect
    login(page, node, node.token)
    expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    assert page.evaluate("Charts.WINDOW_MS") == 15 * 60 * 1000
    marks = page.locator("#chart-tokens .failover-mark")
    expect(marks).to_have_count(0)
    with Load(node.router_url, "m", threads=2, max_tokens=48, stream=True):
        for chart, keys in SERIES.items():  # every figure has a value (a dash means none yet)
            for key in keys:
                legend = page.locator(f'#chart-{chart} .key[data-series="{key}"]')
                expect(legend).not_to_have_text(re.compile(r"–$"), timeout=30_000)
            expect(page.locator(f"#chart-{chart} path.series")).to_have_count(len(keys), timeout=30_000)
        expect(page.locator('#chart-tokens .key[data-series="tok"]')).not_to_have_text(re.compile(r" 0(\.00)?$"))
        old, since = node.primary(), len(node.events)
        stream = Stream(node.router_url, "/v1/completions", LONG)
        stream.wait_chunks(5)
        os.killpg(old["pid"], signal.SIGKILL)
        failover = node.wait_event(lambda e: e["type"] == "failover", since=since)
        expect(marks).to_have_count(1, timeout=10_000)
        stream.result()
        assert stream.done and stream.error is None
    # every stream in flight at the kill was continued: wait until the harness and the page have all of them
    n = int(float(re.search(r'^understudy_migrations_total\{result="continued"\} (\S+)$', node.metrics(), re.M)[1]))
    continued = continued_since(node, since, n)
    item = page.locator("#failover-marks li").first
    expect(item).to_contain_text(f"({n} streams continued, ", timeout=10_000)
    mark = marks.first
    assert (mark.get_attribute("data-from"), mark.get_attribute("data-to")) == (failover["from"], failover["to"])
    assert float(mark.get_attribute("data-seconds")) == failover["seconds"]
    assert float(mark.get_attribute("data-gap")) == max(e["stall_s"] for e in continued)
    expect(page.locator("#charts .failover-mark")).to_have_count(len(SERIES))  # the same mark on every chart
    expect(item).to_contain_text(f'{failover["from"]} → {failover["to"]} (exit): failover ')
    expect(item).to_contain_text("longest stream gap ")
    assert page.errors == []
