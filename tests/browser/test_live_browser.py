"""The live views in a real browser on the shipped small model: a click on a plan block runs the
prompt once (every layer probed), draws the layer's three views; a click on another layer then only
looks up the cached run. Screenshots: test-artifacts/live_*.png."""

from __future__ import annotations

import re
import time

import pytest
from plotly.offline import get_plotlyjs_version

from harness import ARTIFACTS, streamlit_server

RUN_TIMEOUT = 240_000  # ms: the first run loads and dequantizes the model on a 2-core CPU


@pytest.fixture(scope="module")
def server():
    with streamlit_server({"EXPLORER_SOURCE": "shipped"}, "streamlit_live.log") as url:
        yield url


def _plan_point(page, layer: int):
    trace = page.locator(".st-key-plan_chart .js-plotly-plot .scatterlayer .trace").last
    return trace.locator(".point").nth(layer)


def _views_drawn(page, layer: int) -> None:
    """The layer's heading, and its three charts and token strip drawn (each says its layer in data-tag)."""
    page.wait_for_selector(f"h2:has-text('Layer {layer} · ')", timeout=RUN_TIMEOUT)
    for key in ("topk_map", "mhc_token", "routing_map", "token_strip"):
        page.wait_for_selector(f".st-key-{key} [data-tag='layer {layer}']", timeout=RUN_TIMEOUT)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=RUN_TIMEOUT)


def test_click_runs_the_shipped_model_and_draws_the_views(server, browser):
    page = browser.new_page(viewport={"width": 1680, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(server + "/?layer=20&tab=full_m1")
    page.wait_for_selector(".st-key-plan_chart .js-plotly-plot .scatterlayer .point", timeout=RUN_TIMEOUT)
    _views_drawn(page, 20)
    assert page.locator("text=KV from layer 20 · top-k from layer 20").count()
    page.evaluate("() => { document.querySelector('.st-key-topk_map .js-plotly-plot').__kept = true; }")
    _plan_point(page, 24).click(force=True)
    started = time.perf_counter()
    _views_drawn(page, 24)
    page.wait_for_selector("text=KV from layer 20 · top-k from layer 24", timeout=RUN_TIMEOUT)
    click_to_view = time.perf_counter() - started
    # the top-k map of a Reindex layer shows layer 20's candidate pool
    traces = page.evaluate("() => document.querySelector('.st-key-topk_map .js-plotly-plot').data.length")
    assert traces >= 2
    # the plan's ring moved to the clicked block (a layout-only update: Plotly.relayout of the shapes)
    assert page.evaluate("""() => document.querySelector('.st-key-plan_chart .js-plotly-plot')._fullLayout.shapes
        .find(s => s.name === 'ring').yanchor""") == 24
    # the chart was updated in place, not drawn anew in a new element
    assert page.evaluate("() => document.querySelector('.st-key-topk_map .js-plotly-plot').__kept === true")
    # the token strip: one chip per prompt token, the chosen query's picks ringed
    chips = page.locator(".st-key-token_strip .strip > span[title]")
    assert chips.count() > 10 and page.locator(".st-key-token_strip .strip .hl").count() > 0
    # a chart's mode bar downloads it as a PNG, drawn in the browser
    page.locator(".st-key-topk_map .js-plotly-plot").hover()
    with page.expect_download() as download:
        page.locator(".st-key-topk_map .modebar-btn[data-title='Download plot as a PNG']").click()
    png = download.value.path().read_bytes()
    # the name says model, layer, query and prompt (explorer/glossary.py export_name)
    assert re.fullmatch(r"v4-1-flash-live-small-model_layer24_q\d+_p[0-9a-f]{8}_top-k-selections\.png",
                        download.value.suggested_filename) and png[:8] == b"\x89PNG\r\n\x1a\n"
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "live_layer24.png"), full_page=False)
    # charts follow their column's width
    width = page.evaluate("() => document.querySelector('.st-key-routing_map .js-plotly-plot')._fullLayout.width")
    page.set_viewport_size({"width": 1280, "height": 1300})
    page.wait_for_function(f"() => document.querySelector('.st-key-routing_map .js-plotly-plot')._fullLayout.width < {width}",
                           timeout=10_000)
    page.set_viewport_size({"width": 1680, "height": 3600})
    page.wait_for_timeout(1200)
    page.screenshot(path=str(ARTIFACTS / "live_layer24_full.png"))
    assert not page.locator("[data-testid=stException]").count(), "the page shows a traceback"
    assert not errors, errors
    # offline: every request went to the app itself; plotly.js is the installed package's copy
    outside = [u for u in requests if not u.startswith((server, "data:", "blob:"))]
    assert not outside, outside
    assert page.evaluate("() => window.Plotly.version") == get_plotlyjs_version()
    assert any(u.endswith(f"/app/static/plotly-{get_plotlyjs_version()}.min.js") for u in requests)
    print(f"click-to-view after the prompt has run: {click_to_view:.2f} s")
    page.close()
