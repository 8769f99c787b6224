"""URL state and the plan's selection callback, without Streamlit."""

from __future__ import annotations

from types import SimpleNamespace

from engine.config import release_config
from engine.roles import role_plan
from explorer.state import (ViewState, boxes_from_selection, layer_from_selection, select_layer,
                            state_from_query)

PLAN = role_plan(release_config())


def event(*points):
    return {"selection": {"points": list(points), "point_indices": [], "box": [], "lasso": []}}


def test_query_round_trip():
    state = ViewState(layer=25, tab="reuse", position="prefill", session="abc")
    parsed, problems = state_from_query(state.to_query(), PLAN)
    assert parsed == state and problems == []
    assert ViewState(layer=24, tab="reindex").to_query() == {"layer": "24", "tab": "reindex"}


def test_query_layer_sets_its_tab_unless_tab_given():
    assert state_from_query({"layer": "2"}, PLAN)[0].tab == "full_m2"
    assert state_from_query({"layer": "20"}, PLAN)[0].tab == "full_m1"
    s, _ = state_from_query({"layer": "20", "tab": "reuse"}, PLAN)
    assert (s.layer, s.tab) == (20, "reuse")


def test_bad_query_values_fall_back_with_messages():
    s, problems = state_from_query({"layer": "99", "tab": "nope", "pos": "x"}, PLAN)
    assert (s.layer, s.tab, s.position) == (24, "reindex", "total")
    assert len(problems) == 3 and "99" in problems[0] and "nope" in problems[1]
    s, problems = state_from_query({"layer": "abc"}, PLAN)
    assert s.layer == 24 and problems


def test_layer_from_selection_shapes():
    assert layer_from_selection(event({"customdata": [24, "reindex"], "x": 0, "y": 24}), PLAN) == 24
    # attribute-style objects (Streamlit's PlotlyState) work too
    obj = SimpleNamespace(selection=SimpleNamespace(points=[SimpleNamespace(customdata=[3, "reuse"])]))
    assert layer_from_selection(obj, PLAN) == 3
    assert layer_from_selection(event(), PLAN) is None
    assert layer_from_selection(None, PLAN) is None
    # points of other traces (no customdata) are ignored; the last valid one wins
    assert layer_from_selection(event({"x": 1}, {"customdata": [2, "full"]}, {"customdata": [99, "x"]}), PLAN) == 2


def test_select_layer_flips_tab_and_keeps_the_rest():
    start = ViewState(layer=2, tab="full_m2", position="decode")
    s = select_layer(start, event({"customdata": [24, "reindex"]}), PLAN)
    assert (s.layer, s.tab, s.position) == (24, "reindex", "decode")
    assert select_layer(start, event(), PLAN) is start
    assert select_layer(start, event({"customdata": [40, "swa"]}), PLAN).tab == "swa"   # a DSpark stage


def test_boxes_from_selection():
    ev = event({"customdata": ["wq_a|q_norm|wq_b", "q_path"]}, {"customdata": ["wq_b", "topk"]})
    assert boxes_from_selection(ev) == ["wq_a", "q_norm", "wq_b"]
    assert boxes_from_selection(event({"customdata": ["", "head"]})) == []
