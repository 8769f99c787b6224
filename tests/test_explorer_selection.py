"""Score-aware selections and routing margins (explorer/selection_view.py): hand-made probes with
known answers, and a real run of the tiny engine with the on-request detail probes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from explorer import selection_view as sel

# query 0: picks entries 3 (0.9), 1 (0.0), 0 (0.4); runner-ups 2 (0.4) and 5 (0.1): entry 0 ties with entry 2
PROBE = {
    "topk": [[0, 1, 3], [0, -1, -1]],
    "topk_scores": [[0.4, 0.0, 0.9], [2.0, None, None]],
    "runner_ups": [[2, 5, -1], [-1, -1, -1]],
    "runner_up_scores": [[0.4, 0.1, None], [None, None, None]],
    "selection_recall": [0.75, None],
    "routing": {"experts": [[2, 0], [1, 3]], "weights": [[0.6, 0.4], [0.5, 0.5]],
                "scores": [[0.5, 0.1, 0.9, 0.3], [0.2, 0.7, 0.8, 0.6]]},
}


def test_query_scores_rank_the_picks_and_mark_ties():
    qs = sel.query_scores(PROBE, 0)
    assert qs.picks == [(3, 0.9), (0, 0.4), (1, 0.0)]
    assert qs.tied == [False, True, True]       # 0.4 equals the best unpicked; 0.0 is a zero-score pick
    assert qs.kth == 0.0 and qs.best_unpicked == 0.4 and qs.margin == -0.4 and qs.zero_picks == 1
    lone = sel.query_scores(PROBE, 1)
    assert lone.picks == [(0, 2.0)] and lone.runners == [] and lone.tied == [False] and lone.margin is None
    no_detail = sel.query_scores({k: PROBE[k] for k in ("topk", "topk_scores")}, 0)
    assert no_detail.runners is None and no_detail.tied == [False, False, True]
    with pytest.raises(sel.SelectionError, match="outside"):
        sel.query_scores(PROBE, 2)
    with pytest.raises(sel.SelectionError, match="no top-k scores"):
        sel.query_scores({"topk": None}, 0)


def test_zero_score_counts_summary_and_recall():
    assert sel.zero_score_counts(PROBE).tolist() == [1, 0]
    assert sel.zero_score_counts({**PROBE, "zero_score_picks": [5, 6]}).tolist() == [5, 6]   # the probe's own
    s = sel.selection_summary(PROBE)
    assert s == {"picks": 4, "zero_picks": 1, "zero_share": 0.25, "mean_recall": 0.75}
    r = sel.recall_series(PROBE)
    assert r[0] == pytest.approx(0.75) and math.isnan(r[1])


def test_figures_are_valid_plotly_with_titles_and_the_kth_line():
    tokens = ["<bos>", "a", "b", "c", "d", "e", "f", "g"]
    qs = sel.query_scores(PROBE, 0)
    fig = sel.scores_figure(qs, 1, tokens)
    fig.validated()
    assert list(fig.data[0].y) == pytest.approx([0.9, 0.4, 0.0, 0.4, 0.1])
    assert fig.data[0].marker.color == [sel.PICK, sel.TIED, sel.TIED, sel.RUNNER, sel.RUNNER]
    assert fig.layout.shapes[0]["y0"] == 0.0 and fig.layout.yaxis.title.text == "index score"
    assert "entry 3 (token 3: 'c')" in fig.data[0].customdata[0]
    prompt = sel.prompt_figure(PROBE, query=1)
    prompt.validated()
    assert [t["type"] for t in prompt.data] == ["scatter", "scatter"] and prompt.layout.yaxis2.range == [0, 1.02]
    assert "ties" in sel.scores_caption(qs, 7, 7) and "layer 5's indexer" in sel.scores_caption(qs, 6, 5)


def test_routing_margin_is_weakest_chosen_minus_best_other():
    m = sel.routing_margin(PROBE, 0)
    assert m.chosen == [(2, 0.9), (0, 0.5)] and m.others[0] == (3, 0.3)
    assert sel.routing_margins(PROBE).tolist() == pytest.approx([0.5 - 0.3, 0.6 - 0.8])   # token 1: the bias chose 3
    fig = sel.routing_figure(PROBE, 1)
    fig.validated()
    assert fig.data[1].type == "scatter" and fig.layout.yaxis.title.text == "gate score"
    assert "margin: -0.2000" in sel.routing_caption(sel.routing_margin(PROBE, 1), 2)


def test_a_real_run_with_detail_reads_as_the_view_expects():
    from engine.run.api import Engine
    from engine.checkpoint.weights import TensorWeights, random_weights
    from tests.engine_helpers import IdentityTokenizer, random_ids, tiny_config
    cfg = tiny_config()
    engine = Engine(cfg, TensorWeights(random_weights(cfg, 1)), IdentityTokenizer(300))
    run = engine.run(random_ids(cfg, 50).tolist(), layers=[7], detail_layers=[7]).to_json()
    probe = run["layers"]["7"]
    for q in (10, 49):
        qs = sel.query_scores(probe, q)
        assert 0 < len(qs.picks) <= cfg.index_topk and qs.runners is not None   # a small pool may hold fewer
        assert qs.margin is None or qs.margin >= 0     # the indexer never leaves a better entry unpicked
    summary = sel.selection_summary(probe)
    assert summary["picks"] == int((np.asarray(probe["topk"]) >= 0).sum())
    assert 0 < summary["mean_recall"] <= 1


def test_the_combined_chart_keeps_both_panels_axes():
    tokens = ["<bos>", "a", "b", "c", "d", "e", "f", "g"]
    fig = sel.selection_figure(sel.query_scores(PROBE, 0), PROBE, 1, tokens)
    fig.validated()
    axes = [(t.get("xaxis", "x"), t.get("yaxis", "y")) for t in fig.data]
    assert axes[0] == ("x", "y") and ("x2", "y2") in axes and ("x2", "y3") in axes
    assert fig.layout.yaxis3["overlaying"] == "y2" and fig.layout.yaxis3["range"] == [0, 1.02]
    assert any(s.get("xref") == "x2" and s["x0"] == 0 for s in fig.layout.shapes)   # the query's line


def test_the_token_strip_pages_to_the_query_and_escapes_text():
    from explorer.token_strip import page_of, strip_html
    assert page_of(4500, 8192, 2000) == range(4000, 6000) and page_of(8191, 8192, 2000) == range(8000, 8192)
    assert page_of(-3, 10, 4) == range(0, 4) and page_of(0, 0) == range(0)
    tokens = [f"t{i}" for i in range(8192)]
    tokens[4100] = "<b>&"
    html = strip_html(tokens, [1.0] * 8192, query=4100, highlight={4099}, page_size=2000)
    assert html.count("<span data-i=") == 2000 and "data-i='4000'" in html and "data-i='3999'" not in html
    assert "&lt;b&gt;&amp;" in html and "<b>&" not in html
    assert "tokens 4,000-5,999 of 8,192" in html
    assert "data-i='4100' title='#4100 · 1' class='fo'" in html and "data-i='4099' title='#4099 · 1' class='hl'" in html
    short = strip_html(["a", "b"], query=1)
    assert "of 2" not in short and short.count("<span data-i=") == 2


def test_the_engines_tie_marks_win_and_outside_pool_picks_are_labelled():
    probe = {"topk": [[0, 1, 3, 4]], "topk_scores": [[0.4, 0.0, 0.9, -3.4e38]],
             "topk_tied": [[False, True, False, False]]}
    qs = sel.query_scores(probe, 0)
    assert qs.picks[-1] == (4, -3.4e38) and qs.tied == [False, False, True, False]   # marks follow the sort
    assert qs.margin is None
    fig = sel.scores_figure(qs, 1, ["t"] * 6)
    assert list(fig.data[0].y)[-1] == 0.0 and fig.data[0].customdata[-1].endswith("outside the candidate pool (score -inf)")
    assert not fig.layout.get("shapes") or all(s.get("y0") != -3.4e38 for s in fig.layout.shapes)
    assert "outside the candidate pool" in sel.scores_caption(qs, 24, 24)


def test_zero_score_picks_stay_visible():
    qs = sel.query_scores(PROBE, 0)
    fig = sel.scores_figure(qs, 1, ["t"] * 8)
    marks = next(t for t in fig.data if t["type"] == "scatter")
    assert list(marks["y"]) == list(fig.data[0]["y"]) and marks["marker"]["color"] == fig.data[0]["marker"]["color"]
