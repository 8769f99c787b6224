"""Exported images name what they show (issue 14, item 4): the titles and PNG file names of the block
diagram, the parameter tally, the KV panel and the side-by-side charts (explorer/chart_titles.py),
checked against hand-written names and on the real figures, titled as the page titles them."""

from __future__ import annotations

import hashlib

import pytest

from engine.config import load_config
from engine.roles import TAB_TITLES, role_plan
from engine.tally import tally_from_config
from explorer import chart_titles as ct, glossary as gl, kv_view, prompt as pr, session_view as sv
from explorer.diagram import diagram_figure
from explorer.dspark_view import diagram_subject
from explorer.session_compare import compare_layer
from explorer.tally_view import margin_lines, tally_figure
from explorer_synth import synthetic_layer, synthetic_run

RELEASE = load_config(pr.RELEASE_CONFIG)
PLAN = role_plan(RELEASE)
TALLY = tally_from_config(RELEASE)


def test_the_model_is_named_by_its_source():
    assert ct.model_label(pr.SOURCE_CONFIG, str(pr.RELEASE_CONFIG)) == "release config"
    assert ct.model_label(pr.SOURCE_SHIPPED, "/srv/assets/small") == "V4.1-Flash live small model"
    assert ct.model_label(pr.SOURCE_PATH, "/data/ckpt/my-run-7/") == "checkpoint my-run-7"
    # the page's fallback after an unreadable checkpoint draws the release config: it is named so
    assert ct.model_label(pr.SOURCE_PATH, str(pr.RELEASE_CONFIG)) == "release config"


def test_diagram_names_the_layer_its_tab_and_the_model():
    name = ct.diagram_name("release config", "full_m2", TAB_TITLES["full_m2"], PLAN[2], RELEASE)
    assert name.title == "Layer 2 · block diagram (Full (m=2, encoder)) · release config"
    assert name.file == "release-config_layer2_diagram-full-m2"
    live = ct.diagram_name(ct.SHIPPED_MODEL, "reindex", TAB_TITLES["reindex"], PLAN[24], RELEASE)
    assert live.file == "v4-1-flash-live-small-model_layer24_diagram-reindex"
    assert live.title.startswith("Layer 24 · block diagram (Reindex) · ")


def test_a_dspark_stage_is_titled_as_a_stage_not_as_layer_41():
    stage = PLAN[RELEASE.n_layers + 1]
    assert stage.is_dspark
    name = ct.diagram_name("release config", stage.tab, TAB_TITLES[stage.tab], stage, RELEASE)
    assert name.title == "Block diagram of DSpark stage 1 (mtp.1) · release config"
    assert "Layer" not in name.title and "layer41" not in name.file
    assert name.file == "release-config_diagram-mtp1"


def test_tally_says_release_or_live_and_kv_says_release():
    rel = ct.tally_name(ct.RELEASE_MODEL, "decode", "Active per generated token")
    assert rel.title == "Parameter tally, active per generated token · release config"
    assert rel.file == "release-config_tally-decode"
    live = ct.tally_name(ct.SHIPPED_MODEL, "total", "Total")
    assert live.title == "Parameter tally, total · V4.1-Flash live small model"
    assert live.file == "v4-1-flash-live-small-model_tally-total"
    kv = ct.kv_name(1_000_000)
    assert (kv.title, kv.file) == ("KV cache by context length, 1M marked · release config",
                                   "release-config_kv-cache-1m")


def test_side_by_side_names_layer_b_and_the_prompt_hash():
    text = "def fib(n):\n    return n"
    h = hashlib.sha256(text.encode()).hexdigest()[:8]
    name = ct.comparison_name(ct.SHIPPED_MODEL, "routing", "prompt B", 24, text)
    assert name.title == f"Layer 24 · routed experts, A vs prompt B · V4.1-Flash live small model · prompt {h}"
    assert name.file == f"v4-1-flash-live-small-model_layer24_p{h}_side-by-side-routing"
    assert ct.comparison_name("x", "selections", "B", 3, None).file == "x_layer3_side-by-side-selections"
    # a half-width chart: too long for one line, so what it shows, then the model and the prompt
    assert len(name.title) > ct.HALF_WIDTH
    assert name.drawn_title(ct.HALF_WIDTH) == (
        f"Layer 24 · routed experts, A vs prompt B<br>V4.1-Flash live small model · prompt {h}", 36, 13)
    assert name.drawn_title(None) == (name.title, 22, 4)
    short = ct.comparison_name("m", "routing", "B", 2, None)
    assert short.drawn_title(ct.HALF_WIDTH) == ("Layer 2 · routed experts, A vs B · m", 22, 4)


def test_a_session_name_in_the_title_is_shortened_and_not_read_as_tags():
    name = ct.comparison_name("m", "selections", "Reuse at 29 <b>look</b> and a long tail of words", 29, None)
    b = name.title.split(", A vs ")[1].rsplit(" · ", 1)[0]
    assert b == "Reuse at 29 &lt;b&gt;look&lt;/b&gt; and a l…"      # 31 characters of the name, then "…"
    assert "<b>" not in name.title and name.file == "m_layer29_side-by-side-selections"


def _titled(fig, name):
    before = fig.layout.get("height")
    top = (fig.layout.get("margin") or {}).get("t") or 0
    gl.titled(fig, name.title)
    fig.validated()   # still a figure plotly accepts
    assert fig.layout.title.text == name.title
    assert fig.layout.title.yref == "container" and fig.layout.margin.t == top + 22
    assert fig.layout.height == before + 22
    return fig


def test_the_page_figures_carry_their_titles():
    rep, r, drawn, stats, _ = diagram_subject(RELEASE, PLAN, TALLY, "reindex", 24, TAB_TITLES)
    _titled(diagram_figure(drawn, "reindex", stats, role=r),
            ct.diagram_name(ct.RELEASE_MODEL, "reindex", TAB_TITLES["reindex"], r, drawn))
    _titled(tally_figure(margin_lines(TALLY, "total"), "total"), ct.tally_name(ct.RELEASE_MODEL, "total", "Total"))
    _titled(kv_view.kv_figure(RELEASE, 64_000), ct.kv_name(64_000))


@pytest.mark.parametrize("kind", ["selections", "routing"])
def test_the_side_by_side_title_replaces_the_bare_one(kind):
    a = synthetic_run(12, {24: synthetic_layer(12, seed=1)})
    b = synthetic_run(12, {24: synthetic_layer(12, seed=2)})
    fig = sv.comparison_figure(compare_layer(a, b, 24), kind)
    name = ct.comparison_name(ct.SHIPPED_MODEL, kind, "prompt B", 24, "x")
    _titled(fig, name)
    assert fig.layout.title.font.size == 11   # the export title's look, not the bare "A vs B" heading's
