"""The Serving plan view in a real browser: a link opens it with its inputs, the two charts draw, a
widget change redraws it and lands in the URL. Screenshot: test-artifacts/serving_plan.png."""

from __future__ import annotations

import pytest

from harness import ARTIFACTS, choose, streamlit_server

LINK = "/?plan_open=true&plan_gpu=h200&plan_gpus=8&plan_tp=1&plan_ep=8&plan_dp=0&plan_batch=64&plan_ctx=131072"


@pytest.fixture(scope="module")
def server():
    with streamlit_server({"EXPLORER_SOURCE": "config"}, "streamlit_serving_plan.log") as url:
        yield url


def test_serving_plan_from_a_link(server, browser):
    page = browser.new_page(viewport={"width": 1680, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + LINK)
    for key in ("plan_memory_chart", "plan_batch_chart"):
        page.wait_for_selector(f".st-key-{key} .js-plotly-plot .main-svg", timeout=90_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
    # the link's inputs: 8 H200s, EP 8, attention replicated; 64 sequences of 131,072 tokens fit
    metrics = page.locator(".st-key-plan_open [data-testid=stMetric]")
    assert metrics.first.inner_text().startswith("Fits")
    assert page.locator(".st-key-plan_memory_chart .js-plotly-plot .bars .point").count() >= 12
    assert page.locator(".st-key-plan_batch_chart .js-plotly-plot .scatterlayer .trace").count() == 5
    assert "Attention is replicated on 8 groups" in page.locator(".st-key-plan_open").inner_text()
    page.locator(".st-key-plan_open summary").first.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "serving_plan.png"), full_page=False)

    # DP attention: each GPU holds 8 sequences instead of 64; the URL follows
    choose(page, ".st-key-plan_open", "DP attention")
    page.wait_for_function("() => location.search.includes('plan_dp=1')", timeout=30_000)
    page.wait_for_selector(".st-key-plan_open >> text=8 sequence(s) decoding one token each", timeout=30_000)
    page.locator(".st-key-plan_open summary").first.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "serving_plan_dp_attention.png"), full_page=False)
    assert not errors, errors
