"""The real click: Streamlit serving app.py, Debian's chromium driven by Playwright.

Run: `pytest tests/browser -q` (needs `apt-get install -y chromium`; never `playwright install`).
Screenshots land in test-artifacts/. Without chromium the test skips, except under CI=true where it fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
PLAN_LAYER = 24            # the first Reindex layer of the release


def _require_browser() -> None:
    if Path(CHROMIUM).exists():
        return
    message = f"{CHROMIUM} is missing: apt-get install -y chromium"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    _require_browser()
    port = _free_port()
    env = {**os.environ, "EXPLORER_SOURCE": "config", "PYTHONPATH": str(REPO)}
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / "streamlit.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
                             "--server.port", str(port), "--browser.gatherUsageStats", "false"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/_stcore/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited with {proc.returncode}; see test-artifacts/streamlit.log")
            time.sleep(0.5)
    else:
        proc.terminate()
        pytest.fail("streamlit did not answer its health check within 60 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def _wait_app(page) -> None:
    page.wait_for_selector("text=Layer plan", timeout=60_000)
    page.wait_for_selector(".st-key-plan_chart .js-plotly-plot .scatterlayer .point", timeout=60_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
    page.wait_for_timeout(600)


def _plan_point(page, layer: int):
    """Layer L is point L of the plan's last scatter trace (the blocks trace, drawn last)."""
    trace = page.locator(".st-key-plan_chart .js-plotly-plot .scatterlayer .trace").last
    return trace.locator(".point").nth(layer)


def test_click_plan_flips_diagram_and_tally(server, browser):
    page = browser.new_page(viewport={"width": 1680, "height": 1250})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/?layer=2&tab=full_m2")
    _wait_app(page)
    # the URL restored layer 2: heading and tab say so
    page.wait_for_selector("text=Layer 2 · Full m=2", timeout=30_000)
    assert page.locator("[role=tab][aria-selected=true]").first.inner_text().startswith("Full (m=2")
    page.screenshot(path=str(ARTIFACTS / "explorer_layer2.png"), full_page=False)

    _plan_point(page, PLAN_LAYER).click(force=True)
    page.wait_for_selector(f"text=Layer {PLAN_LAYER} · ", timeout=30_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('[role=tab][aria-selected=true]')].some(t => t.innerText.startsWith('Reindex'))",
        timeout=30_000)
    page.wait_for_function("() => location.search.includes('layer=24') && location.search.includes('tab=reindex')",
                           timeout=30_000)
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "explorer_layer24_reindex.png"), full_page=False)

    # switch the tally to "active per generated token"
    page.locator(".st-key-tally_pos").get_by_text("Active per generated token", exact=True).click()
    page.wait_for_function("() => location.search.includes('pos=decode')", timeout=30_000)
    page.wait_for_selector("[data-testid=stMetricValue] >> text=16.13B", timeout=30_000)
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "explorer_tally_decode.png"), full_page=False)

    # a click on the tally's "Q path" row outlines wq_a, q_norm, wq_b in the diagram
    rows = page.locator(".st-key-tally_chart .js-plotly-plot .barlayer .trace").first.locator(".point")
    labels = page.evaluate("() => document.querySelector('.st-key-tally_chart .js-plotly-plot').data[0].y")
    rows.nth(next(i for i, t in enumerate(labels) if t.startswith("Q path"))).click(force=True)
    page.wait_for_selector("button:has-text('Clear highlight')", timeout=30_000)
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "explorer_tally_highlight.png"), full_page=False)
    # a click on the routed experts box scrolls to the live "Expert routing" section
    index = page.evaluate("""() => {
        const gd = document.querySelector('.st-key-diagram_reindex .js-plotly-plot');
        return gd.data[gd.data.length - 1].customdata.findIndex(d => d[0] === 'experts');
    }""")
    targets = page.locator(".st-key-diagram_reindex .js-plotly-plot .scatterlayer .trace").last.locator(".point")
    targets.nth(index).click(force=True)
    page.wait_for_function("""() => { const h = document.getElementById('routing');
        if (!h) return false; const r = h.getBoundingClientRect(); return r.top >= 0 && r.top < innerHeight; }""",
                           timeout=30_000)
    page.wait_for_timeout(600)
    page.screenshot(path=str(ARTIFACTS / "explorer_scrolled_to_routing.png"))

    # the Reuse tab draws borrowed top-k and KV (dashed boxes)
    page.evaluate("() => document.querySelector('[data-testid=stMain]')?.scrollTo(0, 0) ?? window.scrollTo(0, 0)")
    page.get_by_role("tab", name="Reuse").click()
    page.wait_for_function("() => location.search.includes('tab=reuse')", timeout=30_000)
    page.wait_for_selector(".st-key-diagram_reuse .js-plotly-plot", timeout=30_000)
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "explorer_reuse_tab.png"))

    # Streamlit scrolls an inner container, so a tall viewport is what captures the whole page
    page.set_viewport_size({"width": 1680, "height": 2900})
    page.wait_for_timeout(1200)
    page.screenshot(path=str(ARTIFACTS / "explorer_full_page.png"))
    assert not page.locator("[data-testid=stException]").count(), "the page shows a traceback"
    assert not errors, errors
    page.close()
