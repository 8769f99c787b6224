"""The real click: Streamlit serving app.py, Debian's chromium driven by Playwright.

Run: `pytest tests/browser -q` (needs `apt-get install -y chromium`; never `playwright install`).
Screenshots land in test-artifacts/. Without chromium the test skips, except under CI=true where it fails.
"""

from __future__ import annotations

import pytest

from harness import ARTIFACTS, choose, streamlit_server

PLAN_LAYER = 24            # the first Reindex layer of the release


@pytest.fixture(scope="module")
def server():
    with streamlit_server({"EXPLORER_SOURCE": "config"}, "streamlit.log") as url:
        yield url


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
    choose(page, ".st-key-tally_pos", "Active per generated token")
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
