"""The status page (/ui) in a real headless Chromium, driven by Playwright, against one real supervisor
(CPU, tiny model): login with the token, both engines shown, a SIGKILLed primary's failover shown live
(event stream, no reload), recovery, actions that ask first. Chromium comes from the system's
packages (scripts/install); without it these tests FAIL with the reason, they never skip."""
from __future__ import annotations

import os
import re
import shutil
import signal

import httpx
import pytest

from harness.node import running

CONFIG = """
runtime_dir: {rt}
model: {{path: {model}}}
engines: {{heartbeat_interval_s: 0.1, kv_cache_bytes: 4194304, max_num_seqs: 8, max_model_len: 128}}
failover: {{heartbeat_timeout_s: 2, probe_interval_s: 1, hold_timeout_s: 20, backoff_base_s: 0.1,
           backoff_max_s: 1, flap_max: 50, drain_timeout_s: 10, stop_timeout_s: 5}}
router: {{port: 0}}
admin: {{port: 0}}
"""


def chromium_path() -> str:
    """Debian's Chromium; fail (not skip) when it is missing."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is not installed, so the status page cannot be tested in a browser: run "
                    "scripts/install as root (it runs `apt-get install -y chromium`)", pytrace=False)
    return path


def test_without_chromium_the_browser_tests_fail_and_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="Chromium is not installed.*scripts/install"):
        chromium_path()


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("ui")
    with running(work, CONFIG.format(rt=work / "rt", model=tiny_model), notify=False) as h:
        yield h


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.fail(f"playwright is not installed ({e}): run scripts/install", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context()
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # (a refused fetch, 401 or 409, is logged by Chromium as "Failed to load resource": expected here)
    pg.on("console", lambda m: errors.append(m.text)
          if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
    pg.errors = errors
    yield pg
    ctx.close()


def login(page, node, token: str) -> None:
    page.goto(node.admin_url + "/ui")
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")


def test_the_page_is_public_but_holds_no_data_and_the_stream_needs_the_token(node):
    r = httpx.get(node.admin_url + "/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'sha256-" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert node.token not in r.text and "engines" in r.text
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        ev = httpx.get(node.admin_url + "/events", headers=headers)
        assert ev.status_code == 401 and "bearer token" in ev.json()["error"]
    assert httpx.get(node.admin_url + "/status").status_code == 401  # the rest of the API is unchanged


def test_wrong_token_is_refused_and_the_right_one_shows_both_engines(node, page):
    from playwright.sync_api import expect
    login(page, node, "not-the-token")
    expect(page.locator("#login-error")).to_contain_text("refused (401)")
    expect(page.locator("#app")).to_be_hidden()
    login(page, node, node.token)
    expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    st = node.wait_all_ready()
    rows = page.locator("#engines tbody tr")
    expect(rows).to_have_count(2)
    for e in st["engines"]:
        row = page.locator(f'#engines tr[data-engine="{e["name"]}"]')
        expect(row.locator(".role")).to_have_text(e["role"])
        expect(row.locator(".state")).to_have_text("READY")
        expect(row.locator(".pid")).to_have_text(str(e["pid"]))
        expect(row.locator(".incarnation")).to_have_text(str(e["incarnation"]))
        expect(row.locator(".weights")).to_have_text("cache_hit")
        # shared KV: the primary writes the daemon's pool, the standby is parked on its scratch blocks
        expect(row.locator(".kv")).to_contain_text("writer" if e["role"] == "primary" else "parked", timeout=10_000)
    expect(page.locator(f'#engines tr[data-engine="{st["primary"]}"] .epoch')).to_have_text(str(st["epoch"]))
    expect(page.locator('#daemons tr[data-daemon="daemon-rank0"] .state')).to_have_text("READY")
    expect(page.locator('#daemons tr[data-daemon="daemon-rank0"] .kv-pool')).to_contain_text("blocks of 16 tokens")
    # boot is in the timeline (the stream's history), and the token stays in the tab, not in a URL
    expect(page.locator('#timeline li[data-event="promoted"]')).to_have_count(1)
    assert node.token not in page.url
    page.reload()
    expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    expect(page.locator("#login")).to_be_hidden()
    assert page.errors == []


def test_at_1300_px_every_table_stays_inside_its_card(node, page):
    """A wide table scrolls inside its card (the engines' table overflowed its card at 1300 px)."""
    from playwright.sync_api import expect
    page.set_viewport_size({"width": 1300, "height": 900})
    login(page, node, node.token)
    expect(page.locator("#engines tbody tr")).to_have_count(2, timeout=10_000)
    spill = page.evaluate("""() => [...document.querySelectorAll('main section')]
        .filter(s => s.scrollWidth > s.clientWidth).map(s => s.querySelector('h2').textContent)""")
    assert spill == []
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 1300
    for table in ("#engines", "#daemons"):
        assert page.evaluate(f"() => getComputedStyle(document.querySelector('{table}').parentElement).overflowX") == "auto"


def test_a_killed_primary_shows_as_a_failover_live_without_a_reload(node, page):
    """The failover reaches the open page through the event stream: the same page (no reload, no poll
    of /status brought it: a marker set before the kill survives) shows it with the supervisor's
    epoch. How fast is the failover benchmark's figure, not this test's."""
    from playwright.sync_api import expect
    old = node.primary()
    new = node.standby()
    login(page, node, node.token)
    expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    expect(page.locator(f'#engines tr[data-engine="{old["name"]}"] .role')).to_have_text("primary")
    before = page.locator('#timeline li[data-event="failover"]').count()
    page.evaluate("window.__before_kill = true")
    since = len(node.events)
    os.kill(old["pid"], signal.SIGKILL)
    ev = node.wait_event(lambda e: e["type"] == "failover" and e["from"] == old["name"], 30, since)
    failover = page.locator('#timeline li[data-event="failover"]')
    expect(failover).to_have_count(before + 1, timeout=30_000)
    expect(page.locator(f'#engines tr[data-engine="{new["name"]}"] .role')).to_have_text("primary", timeout=30_000)
    expect(page.locator(f'#engines tr[data-engine="{new["name"]}"] .epoch')).to_have_text(str(ev["epoch"]))
    assert page.evaluate("window.__before_kill === true"), "the page was reloaded"
    expect(failover.first).to_contain_text(f'{old["name"]} → {new["name"]} (exit)')
    # then the dead engine's restart and recovery, still without a reload
    expect(page.locator('#timeline li[data-event="recovered"]').first).to_contain_text(old["name"], timeout=60_000)
    expect(page.locator(f'#engines tr[data-engine="{old["name"]}"] .incarnation')).to_have_text(
        str(old["incarnation"] + 1), timeout=10_000)
    expect(page.locator(f'#engines tr[data-engine="{old["name"]}"] .last-exit')).to_have_text("killed by SIGKILL")
    expect(page.locator('#timeline li[data-type="down"]').first).to_contain_text(
        re.compile(rf'{old["name"]} \((primary|standby)\) READY → EXITED'))
    assert page.errors == []


def test_actions_ask_first_and_drain_and_undrain_the_node(node, page):
    from playwright.sync_api import expect
    node.wait_all_ready()
    login(page, node, node.token)
    expect(page.locator("#conn")).to_have_text("live", timeout=10_000)
    asked: list[str] = []

    def answer(accept: bool):
        def on_dialog(d):
            asked.append(d.message)
            d.accept() if accept else d.dismiss()
        return on_dialog

    page.once("dialog", answer(False))
    page.click("#drain")
    expect(page.locator("#drain")).to_have_text("Drain node")
    assert asked and "Drain this node" in asked[-1] and node.status()["drained"] is False
    page.once("dialog", answer(True))
    page.click("#drain")
    expect(page.locator("#drain")).to_have_text("Undrain node", timeout=5000)
    assert node.status()["drained"] is True
    rz = httpx.get(node.router_url + "/readyz")
    assert rz.status_code == 503 and rz.json()["reason"] == "node is drained"
    expect(page.locator('#timeline li[data-event="drained"]').first).to_contain_text("node drained")
    page.once("dialog", answer(True))
    page.click("#drain")
    expect(page.locator("#drain")).to_have_text("Drain node", timeout=5000)
    assert httpx.get(node.router_url + "/readyz").status_code == 200
    # promote (a planned switchover), then at once again: refused, and the page says why
    node.wait_all_ready()
    primary = node.status()["primary"]
    page.once("dialog", answer(True))
    page.click("#promote")
    expect(page.locator("#action-result")).to_contain_text(f'"previous":"{primary}"', timeout=10_000)
    page.once("dialog", answer(True))
    page.click("#promote")
    expect(page.locator("#action-result.error")).to_contain_text(  # (shared KV: the first may still be under way)
        re.compile("HTTP 409: (no READY standby|a switch of primary is already under way)"), timeout=10_000)
    assert len(asked) == 5 and all("Promote the standby" in q for q in asked[-2:])
    assert node.status()["primary"] != primary
    # restart the standby from its row, then a rollout: every engine comes back with a new incarnation
    st = node.wait_all_ready()
    sb = next(e for e in st["engines"] if e["role"] == "standby")
    page.once("dialog", answer(True))
    page.click(f'#engines tr[data-engine="{sb["name"]}"] button.restart')
    expect(page.locator(f'#engines tr[data-engine="{sb["name"]}"] .incarnation')).to_have_text(
        str(sb["incarnation"] + 1), timeout=30_000)
    assert asked[-1].startswith(f'Restart engine {sb["name"]} (standby)?')
    incs = {e["name"]: e["incarnation"] for e in node.wait_all_ready()["engines"]}
    page.once("dialog", answer(True))
    page.click("#rollout")
    expect(page.locator("#action-result")).to_contain_text('"restarted":', timeout=120_000)
    assert "Rollout" in asked[-1]
    st = node.wait_all_ready()
    assert all(e["incarnation"] > incs[e["name"]] for e in st["engines"])
    for e in st["engines"]:
        expect(page.locator(f'#engines tr[data-engine="{e["name"]}"] .incarnation')).to_have_text(str(e["incarnation"]))
    assert page.errors == []
