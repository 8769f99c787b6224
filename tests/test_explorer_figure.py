"""Figures as plain data (explorer/figure.py) and the chart component (explorer/components.py).

The builders skip plotly's per-property validation at run time; here every builder's output is checked
against plotly's schema instead, on the release config and on a synthetic 1,000-token run."""

from __future__ import annotations

import base64
import json

import numpy as np
import plotly.graph_objects as go
import pytest

from engine.config import release_config
from engine.roles import TABS, role_plan
from engine.tally import tally_from_config
from explorer import layer_views as lv, session_view as sv
from explorer.diagram import diagram_figure
from explorer.figure import Figure, Props, merge
from explorer.kv_view import kv_figure
from explorer.plan import plan_figure
from explorer.components import chart_payload, plotly_js_name, plotly_js_source, publish_plotly_js
from explorer.session_compare import compare_layer
from explorer.state import POSITIONS
from explorer.tally_view import box_stats, layer_params, margin_lines, representative_layer, tally_figure
from explorer_synth import synthetic_layer, synthetic_run

CFG = release_config()
PLAN = role_plan(CFG)
TALLY = tally_from_config(CFG)


def decode(block: dict) -> np.ndarray:
    """A typed-array block as plotly.js reads it."""
    dtype = {"f4": np.float32, "f8": np.float64, "i4": np.int32, "u1": np.uint8, "i2": np.int16}[block["dtype"]]
    arr = np.frombuffer(base64.b64decode(block["bdata"]), dtype=dtype)
    return arr.reshape([int(n) for n in block["shape"].split(",")]) if "shape" in block else arr


def test_props_read_like_plotly_objects():
    p = Props(a=1, nested={"b": {"c": 2}}, shapes=[{"name": "ring"}])
    assert p.a == 1 and p.nested.b.c == 2 and p.missing is None and p.shapes[0].name == "ring"
    with pytest.raises(AttributeError):
        p.__wrapped__
    base = {"xaxis": {"range": [0, 1], "title": {"text": "x"}}, "height": 100}
    merge(base, {"xaxis": {"title": {"font": {"size": 11}}}, "height": 200})
    assert base == {"xaxis": {"range": [0, 1], "title": {"text": "x", "font": {"size": 11}}}, "height": 200}


def test_numpy_arrays_ship_as_typed_blocks():
    z = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    fig = Figure([dict(type="heatmap", z=z, x=np.arange(4, dtype=np.int64), customdata=np.array(["a", "b"]),
                       zmax=np.float32(2.5))])
    trace = json.loads(fig.to_json())["data"][0]
    assert trace["z"]["dtype"] == "f4" and trace["z"]["shape"] == "3, 4"
    np.testing.assert_array_equal(decode(trace["z"]), z)
    assert trace["x"]["dtype"] == "i4" and decode(trace["x"]).tolist() == [0, 1, 2, 3]    # int64 is not a JS type
    assert trace["customdata"] == ["a", "b"] and trace["zmax"] == 2.5
    with pytest.raises(ValueError, match="type"):
        Figure().add_trace(dict(x=[1]))


def test_schema_rejects_what_the_builders_must_not_write():
    with pytest.raises(ValueError):
        Figure([dict(type="scatter", colour="red")]).validated()
    assert isinstance(Figure([dict(type="scatter", x=np.arange(3.0))]).validated(), go.Figure)


def synthetic_views(T: int = 1000, image: bool = False):
    mask = [t % 5 == 0 for t in range(T)] if image else None
    run = synthetic_run(T, {24: synthetic_layer(T, k=64, n_experts=384, seed=3, image=mask)}, image=mask)
    probe = lv.layer_probe(run, 24)
    topk, routing = lv.topk_model(run, probe), lv.routing_model(run, probe, 384)
    tokens = run["tokens"]
    return {
        "topk": lv.topk_figure(topk, query=T - 1),
        "mhc_token": lv.mhc_token_figure(probe, T // 2),
        "mhc_lines": lv.side_by_side(lv.mhc_lines_figure(probe, tokens), lv.residual_norms_figure(probe, tokens), 0.5),
        "routing": lv.side_by_side(lv.routing_heatmap(routing, tokens), lv.expert_load_figure(routing)),
    }


def assert_for_plotly_js(fig) -> None:
    """Valid in plotly's schema, and nothing plotly.py would have rewritten on the way: colour scales are
    spelled out (plotly.js reads "Blues" differently), titles are {text: ...} objects."""
    checked = fig.validated()
    assert len(checked.data) == len(fig.data)
    spec = fig.to_plotly_json()

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "colorscale":
                    assert isinstance(value, list), f"{path}.{key} is a name: {value!r}"
                if key == "title" and path != "layout.template":
                    assert isinstance(value, dict), f"{path}.{key} is a bare string"
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for item in node:
                walk(item, path)
    walk(spec, "")


@pytest.mark.parametrize("T,image", [(1000, False), (12, True)])
def test_every_live_view_is_a_valid_plotly_figure(T, image):
    for fig in synthetic_views(T, image).values():
        assert_for_plotly_js(fig)


def test_every_page_figure_is_a_valid_plotly_figure():
    figs = [plan_figure(CFG, PLAN, layer_params=layer_params(TALLY), selected=24), kv_figure(CFG, 65_536,
            measured={"context_len": 1000, "total": 10**6})]
    for tab in TABS:
        rep = representative_layer(tab, PLAN, 24)
        figs.append(diagram_figure(CFG, tab, box_stats(TALLY, rep), role=PLAN[rep], highlight={"wq_b"}))
    figs += [tally_figure(margin_lines(TALLY, pos), pos, highlight="routed") for pos in POSITIONS]
    a = synthetic_run(12, {24: synthetic_layer(12, seed=1)})
    b = synthetic_run(12, {24: synthetic_layer(12, seed=2)})
    figs += [sv.comparison_figure(compare_layer(a, b, 24), kind) for kind in ("selections", "routing")]
    for fig in figs:
        assert_for_plotly_js(fig)


def test_side_by_side_keeps_both_panels():
    left = Figure([dict(type="scatter", y=[1, 2])], dict(height=200, yaxis=dict(title=dict(text="a"))))
    right = Figure([dict(type="bar", y=[3])], dict(height=260, showlegend=True, legend=dict(orientation="h"),
                                                  xaxis=dict(title=dict(text="expert"))))
    fig = lv.side_by_side(left, right, share=0.5, gap=0.1)
    assert [t.type for t in fig.data] == ["scatter", "bar"] and fig.data[1].xaxis == "x2"
    assert fig.data[0].xaxis is None and right.data[0].xaxis is None       # the inputs are left alone
    assert fig.layout.height == 260 and fig.layout.showlegend and fig.layout.legend.orientation == "h"
    assert fig.layout.legend.x == 0.55 and fig.layout.legend.xanchor == "left"     # over the right panel
    assert fig.layout.xaxis.domain == [0, 0.45] and fig.layout.xaxis2.domain == [0.55, 1]
    assert fig.layout.xaxis2.title.text == "expert" and fig.layout.yaxis.title.text == "a"
    fig.validated()


def payload(fig, **kw) -> dict:
    return json.loads(chart_payload(fig, src="app/static/p.js", **kw))


def test_payload_carries_a_digest_of_the_traces():
    at24 = payload(plan_figure(CFG, PLAN, selected=24), tag="layer 24", config={"displayModeBar": False})
    at3 = payload(plan_figure(CFG, PLAN, selected=3))
    assert at24["src"] == "app/static/p.js" and at24["tag"] == "layer 24" and at24["config"] == {"displayModeBar": False}
    # a new selection moves the ring (layout) only: same digest, so the browser keeps the traces
    assert at24["figure"]["data"] == at3["figure"]["data"]
    assert at24["figure"]["layout"]["datarevision"] == at3["figure"]["layout"]["datarevision"]
    assert at24["figure"]["layout"]["shapes"] != at3["figure"]["layout"]["shapes"]
    views = [payload(f) for f in synthetic_views(40).values()]
    run, probe = _run_probe(seed=9)
    other = payload(lv.mhc_token_figure(probe, 20))
    assert other["figure"]["layout"]["datarevision"] != views[1]["figure"]["layout"]["datarevision"]
    assert len({v["figure"]["layout"]["datarevision"] for v in views}) == len(views)


def _run_probe(seed: int):
    run = synthetic_run(40, {24: synthetic_layer(40, k=64, n_experts=384, seed=seed)})
    return run, lv.layer_probe(run, 24)


def test_plotly_js_is_published_from_the_installed_package(tmp_path):
    url = publish_plotly_js(tmp_path / "static")
    target = tmp_path / "static" / plotly_js_name()
    assert url == f"app/static/{plotly_js_name()}" and target.read_bytes() == plotly_js_source().read_bytes()
    target.write_bytes(b"truncated")                 # a half-written or stale copy is replaced
    publish_plotly_js(tmp_path / "static")
    assert target.read_bytes() == plotly_js_source().read_bytes()
    assert [p.name for p in (tmp_path / "static").iterdir()] == [plotly_js_name()]    # no temporary left


def _chart_script(static: bool, static_dir: str):
    """A one-chart app: the explorer's chart under key 'chart', clicks counted in session state."""
    from pathlib import Path

    import streamlit as st

    from explorer import components as pc
    from explorer.figure import Figure

    pc.static_serving = lambda: static
    fig = Figure([dict(type="scatter", x=[0, 1], y=[2, 3], customdata=[["a"], ["b"]])], dict(height=200))
    pc.plotly_chart(fig, key="chart", static_dir=Path(static_dir), tag="t1",
                    on_click=lambda points: st.session_state.update(clicked=points))


@pytest.mark.parametrize("static", [True, False, "unwritable"])
def test_chart_in_an_app(static, tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from explorer import components
    monkeypatch.setattr(components, "static_serving", components.static_serving)  # restored after
    static_dir = tmp_path
    if static == "unwritable":    # a read-only install: the static folder cannot be made
        (tmp_path / "file").write_text("")
        static_dir = tmp_path / "file" / "static"
    at = AppTest.from_function(_chart_script, kwargs=dict(static=bool(static), static_dir=str(static_dir))).run()
    assert not at.exception
    if static is True:      # the component: one keyed element, plotly.js published for it
        assert [e.key for e in at.get("bidi_component")] == ["chart"]
        assert (tmp_path / plotly_js_name()).exists()
    else:                   # static serving off or nowhere to put plotly.js: Streamlit's own chart, same figure
        spec = json.loads(at.get("plotly_chart")[0].proto.spec)
        assert spec["data"][0]["y"] == [2, 3] and not (tmp_path / plotly_js_name()).exists()
