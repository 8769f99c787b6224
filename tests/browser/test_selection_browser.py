"""Reading the selections in a real browser (issue 14): the release's tally on the first paint, a click
on a token sets the query of every live view (and a click on a row of the top-k map does too), a tie
shows as a tie, and an exported PNG carries its title and a name that says what it shows.
Screenshots: test-artifacts/selection_*.png."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest

from harness import ARTIFACTS, choose, press, streamlit_server, type_and_commit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from explorer_synth import synthetic_layer, synthetic_run  # noqa: E402

RUN_TIMEOUT = 240_000      # ms: the first run loads and dequantizes the model on a 2-core CPU
TIED, PICK = "#E69F00", "#0072B2"
VIEWS = ("topk_map", "topk_scores", "token_strip", "mhc_token", "routing_map", "routing_margin")


def _title(page, key: str) -> str:
    return page.evaluate(f"() => document.querySelector('.st-key-{key} .js-plotly-plot').layout.title.text")


def _views_drawn(page, layer: int) -> None:
    page.wait_for_selector(f"h2:has-text('Layer {layer} · ')", timeout=RUN_TIMEOUT)
    for key in VIEWS:
        page.wait_for_selector(f".st-key-{key} [data-tag='layer {layer}']", timeout=RUN_TIMEOUT)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=RUN_TIMEOUT)


def _query_everywhere(page, q: int) -> None:
    """Every live view's title names query q (titles travel into the PNG exports)."""
    keys = ("topk_map", "topk_scores", "mhc_token", "routing_margin")
    page.wait_for_function(
        "(q) => " + " && ".join(f"(document.querySelector('.st-key-{k} .js-plotly-plot')?.layout?.title?.text || '')"
                                f".includes('query ' + q + ' ')" for k in keys), arg=q, timeout=60_000)


@pytest.fixture(scope="module")
def server():
    with streamlit_server({"EXPLORER_SOURCE": "shipped"}, "streamlit_selection.log") as url:
        yield url


def test_release_tally_is_on_the_first_paint(server, browser):
    page = browser.new_page(viewport={"width": 1680, "height": 1100})
    page.goto(server + "/?layer=24&tab=reindex")
    page.wait_for_selector(".st-key-plan_chart .js-plotly-plot .scatterlayer .point", timeout=RUN_TIMEOUT)
    head = page.locator(".release-head").inner_text()
    assert "763.2B parameters" in head and "890 B of global KV per token" in head
    assert re.search(r"live model: 50\.\d+M parameters, same 40-layer plan, widths scaled", page.content())
    metrics = page.locator("[data-testid=stMetric]").all_inner_texts()
    assert any("Release" in m and "763.2B" in m for m in metrics), metrics
    page.screenshot(path=str(ARTIFACTS / "selection_first_paint.png"))
    # the tally's PNG says whose rows it shows: the release's first, the live model's on request
    assert _title(page, "tally_chart") == "Parameter tally, total · release config"
    assert _title(page, "diagram_reindex") == "Layer 24 · block diagram (Reindex) · V4.1-Flash live small model"
    page.locator(".st-key-tally_chart .js-plotly-plot").hover()
    with page.expect_download() as download:
        page.locator(".st-key-tally_chart .modebar-btn[data-title='Download plot as a PNG']").click()
    assert download.value.suggested_filename == "release-config_tally-total.png"
    _title_is_drawn(download.value.path().read_bytes())
    choose(page, ".st-key-tally_of", "live model")
    page.wait_for_function("() => document.querySelector('.st-key-tally_chart .js-plotly-plot')?.layout?.title?.text"
                           " === 'Parameter tally, total · V4.1-Flash live small model'", timeout=60_000)
    page.close()


def test_a_click_on_a_token_sets_the_query_in_every_view(server, browser):
    page = browser.new_page(viewport={"width": 1680, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/?layer=24&tab=reindex")
    _views_drawn(page, 24)
    page.locator(".st-key-token_strip span[data-i='12']").click()
    _query_everywhere(page, 12)
    assert page.locator(".st-key-token_strip .strip .fo").get_attribute("data-i") == "12"
    # the picks on screen follow the engine's tie marks: orange bars are labelled ties, all at the k-th score
    bars = page.evaluate("() => { const d = document.querySelector('.st-key-topk_scores .js-plotly-plot')._fullData[0];"
                         " return {y: Array.from(d.y), c: d.marker.color, t: d.customdata}; }")
    assert len(bars["y"]) == len(bars["c"]) == len(bars["t"]) > 0
    for y, c, t in zip(bars["y"], bars["c"], bars["t"]):
        if t.endswith("picked") or t.endswith("tie"):
            assert (c == TIED) == t.endswith("tie")
    picked = [y for y, t in zip(bars["y"], bars["t"]) if t.endswith(("picked", "tie"))]
    assert all(y == min(picked) for y, c in zip(bars["y"], bars["c"]) if c == TIED)
    # a click on a row of the top-k map makes that row the query
    box = page.locator(".st-key-topk_map .nsewdrag").first.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.6)
    page.wait_for_function("() => !document.querySelector('.st-key-topk_map .js-plotly-plot')"
                           ".layout.title.text.includes('query 12 ')", timeout=60_000)
    q = int(re.search(r"query (\d+) ", _title(page, "topk_map")).group(1))
    assert q > 12
    _query_everywhere(page, q)
    # on request: the runner-ups and the selection recall of the clicked layer
    press(page, page.get_by_role("button", name=re.compile("Score the unpicked entries")),
          "() => document.body.innerText.includes('mean selection recall')", timeout=RUN_TIMEOUT)
    page.wait_for_function("() => document.querySelector('.st-key-topk_scores .js-plotly-plot').data"
                           ".some(t => t.name === 'selection recall')", timeout=60_000)
    page.wait_for_timeout(600)
    page.locator(".st-key-topk_scores").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "selection_scores_recall.png"))
    # a PNG export carries its title, and its name says model, layer, query and prompt
    page.locator(".st-key-topk_scores .js-plotly-plot").hover()
    with page.expect_download() as download:
        page.locator(".st-key-topk_scores .modebar-btn[data-title='Download plot as a PNG']").click()
    name = download.value.suggested_filename
    assert re.fullmatch(rf"v4-1-flash-live-small-model_layer24_q{q}_p[0-9a-f]{{8}}_index-scores-of-the-picks\.png",
                        name), name
    png = download.value.path().read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert _title(page, "topk_scores").startswith(f"Layer 24 · index scores of the picks · query {q} · ")
    _title_is_drawn(png)
    page.locator(".st-key-routing_margin").scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "selection_routing_margin.png"))
    page.set_viewport_size({"width": 1680, "height": 4200})
    page.wait_for_timeout(1200)
    page.screenshot(path=str(ARTIFACTS / "selection_page_full.png"))
    assert not page.locator("[data-testid=stException]").count(), "the page shows a traceback"
    assert not errors, errors
    page.close()


def test_side_by_side_aligns_the_tokens_first(server, browser):
    page = browser.new_page(viewport={"width": 1680, "height": 1300})
    page.goto(server + "/?layer=24&tab=reindex")
    _views_drawn(page, 24)
    text = page.locator(".st-key-prompt_text textarea").input_value()
    cut = text.index("\n") + 1
    choose(page, ".st-key-cmp_mode", "another prompt", shows=".st-key-cmp_prompt textarea")
    type_and_commit(page, ".st-key-cmp_prompt textarea", text[:cut] + "# a small edit\n" + text[cut:])
    press(page, page.locator(".st-key-cmp_run button"), "() => !!document.querySelector('.st-key-cmp_aligned')",
          timeout=RUN_TIMEOUT)
    line = page.locator(".st-key-cmp_aligned").inner_text()
    assert "0 only in A" in line and "(1 edit)" in line and "inserted '" in line
    page.locator(".st-key-cmp_aligned").scroll_into_view_if_needed()
    page.wait_for_timeout(800)
    page.screenshot(path=str(ARTIFACTS / "selection_side_by_side_aligned.png"))
    page.close()


def _title_is_drawn(png: bytes) -> None:
    """The exported image has ink in its title band (top-left), where an untitled chart has none."""
    from PIL import Image
    img = Image.open(io.BytesIO(png)).convert("L")
    band = img.crop((0, 0, img.width // 2, 32))      # scale 2: the title's first 16 px, above the legend
    assert band.getextrema()[0] < 160, "no title drawn at the top of the exported PNG"


@pytest.fixture(scope="module")
def tie_server(tmp_path_factory):
    """A saved run whose query 9 took two of four entries scored 0 (a tie, marked as the engine marks it)."""
    T = 12
    layer = synthetic_layer(T, k=4, index_source=24, seed=3)
    layer["topk"][9] = [1, 2, 5, 7]
    layer["topk_scores"][9] = [0.9, 0.0, 0.6, 0.0]
    layer["topk_tied"] = [[False] * 4 for _ in range(T)]
    layer["topk_tied"][9] = [False, True, False, True]
    layer["runner_ups"] = [[-1, -1] for _ in range(T)]
    layer["runner_up_scores"] = [[None, None] for _ in range(T)]
    layer["runner_ups"][9], layer["runner_up_scores"][9] = [4, 8], [0.0, 0.0]
    path = tmp_path_factory.mktemp("tie") / "run.json"
    path.write_text(json.dumps(synthetic_run(T, {24: layer})))
    with streamlit_server({"EXPLORER_SOURCE": "shipped", "EXPLORER_RUN_JSON": str(path)},
                          "streamlit_selection_tie.log") as url:
        yield url


def test_a_tie_shows_as_a_tie(tie_server, browser):
    page = browser.new_page(viewport={"width": 1680, "height": 1300})
    page.goto(tie_server + "/?layer=24&tab=reindex")
    page.wait_for_selector(".st-key-token_strip [data-tag='layer 24']", timeout=RUN_TIMEOUT)
    page.locator(".st-key-token_strip span[data-i='9']").click()
    page.wait_for_function("() => (document.querySelector('.st-key-topk_scores .js-plotly-plot')?.layout?.title?.text"
                           " || '').includes('query 9 ')", timeout=60_000)
    bars = page.evaluate("() => { const d = document.querySelector('.st-key-topk_scores .js-plotly-plot')._fullData[0];"
                         " return {y: Array.from(d.y).map(v => Math.round(v * 100) / 100), c: d.marker.color}; }")
    # ranked: 0.9, 0.6 (picked), the two picks at 0 (ties: unpicked entries 4 and 8 score 0 too), the unpicked
    assert bars["y"] == [0.9, 0.6, 0.0, 0.0, 0.0, 0.0]
    assert bars["c"][:4] == [PICK, PICK, TIED, TIED] and bars["c"][4:] == ["#A6A6A6", "#A6A6A6"]
    assert page.locator("text=2 of 4 picks scored exactly 0").count() == 1
    assert page.locator("text=(margin 0)").count() >= 1       # the 4th pick (0) vs the best unpicked (0)
    page.locator(".st-key-topk_scores").scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(ARTIFACTS / "selection_tie.png"))
    page.close()
