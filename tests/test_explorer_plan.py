"""The plan figure: roles, colours and arcs come from the role plan, for the release and another config."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig, release_config
from engine.roles import role_plan
from explorer.plan import BLOCK_TRACE, describe_layer, plan_edges, plan_figure, plan_legend, y_of
from explorer.style import ROLE_COLOURS


def small_config() -> ModelConfig:
    """12 layers + 1 DSpark stage with other lists: 0 SWA; 1, 4 Full m=2; 6 Full m=1 (candidate source);
    8, 10 Reindex; the rest Reuse."""
    return release_config().replace(
        n_layers=12, n_mtp_layers=1, compress_ratios=(0,) + (2,) * 5 + (1,) * 6 + (0,),
        kv_source_layers=(1, 4, 6), index_source_layers=(1, 4, 6, 8, 10), candidate_source_layer=6,
        engram_layer_ids=(2,), engram_num_embeddings=(1000,), dspark_target_layer_ids=(11,))


def blocks(fig):
    traces = [t for t in fig.data if t.name == BLOCK_TRACE]
    assert len(traces) == 1
    assert fig.data[-1].name == BLOCK_TRACE, "the blocks must be the last trace (the browser test relies on it)"
    return traces[0]


def test_release_blocks_carry_layer_and_role():
    cfg = release_config()
    fig = plan_figure(cfg)
    b = blocks(fig)
    assert len(b.customdata) == 43
    data = [list(d) for d in b.customdata]
    assert data[0] == [0, "swa"] and data[2] == [2, "full"] and data[24] == [24, "reindex"]
    assert data[25] == [25, "reuse"] and data[20] == [20, "full"] and data[40] == [40, "swa"]
    colours = list(b.marker.color)
    assert colours[2] == ROLE_COLOURS["full_m2"] and colours[20] == ROLE_COLOURS["full_m1"]
    assert colours[24] == ROLE_COLOURS["reindex"] and colours[3] == ROLE_COLOURS["reuse"]
    assert colours[0] == ROLE_COLOURS["swa"]
    assert all(m == "square" for m in [b.marker.symbol])
    # layer 0 at the bottom, DSpark apart on top
    ys = list(b.y)
    assert ys[:40] == [float(i) for i in range(40)]
    assert ys[40] - ys[39] > 1.5


def test_release_edges_match_the_spec_table():
    cfg = release_config()
    edges = {(e.reader, e.source, e.side) for e in plan_edges(cfg)}
    # spec section 2: 3-7 borrow KV and top-k from 2; 25 reads KV of 20 and top-k of 24; 24 scores 20's pool
    assert {(3, 2, "kv"), (3, 2, "topk"), (19, 14, "kv"), (25, 20, "kv"), (25, 24, "topk"),
            (24, 20, "kv"), (24, 20, "candidates"), (39, 20, "kv"), (39, 36, "topk")} <= edges
    assert not any(reader == 24 and side == "topk" for reader, _, side in edges)
    assert not any(reader in (0, 1, 2, 8, 14, 20) for reader, _, _ in edges)
    assert {(40, 37, "dspark_tap"), (41, 38, "dspark_tap"), (42, 39, "dspark_tap")} <= edges
    # KV readers by hand: 15 encoder Reuse + 21-23 + 4 Reindex + 12 decoder Reuse
    assert sum(1 for e in edges if e[2] == "kv") == 15 + 3 + 4 + 12
    assert sum(1 for e in edges if e[2] == "candidates") == 4


def test_other_config_roles_and_edges():
    cfg = small_config()
    plan = role_plan(cfg)
    fig = plan_figure(cfg, plan)
    data = [list(d) for d in blocks(fig).customdata]
    expected = ["swa", "full", "reuse", "reuse", "full", "reuse", "full", "reuse", "reindex", "reuse", "reindex",
                "reuse", "swa"]
    assert [d[1] for d in data] == expected
    edges = {(e.reader, e.source, e.side) for e in plan_edges(cfg, plan)}
    assert edges == {
        (2, 1, "kv"), (2, 1, "topk"), (3, 1, "kv"), (3, 1, "topk"), (5, 4, "kv"), (5, 4, "topk"),
        (7, 6, "kv"), (7, 6, "topk"), (8, 6, "kv"), (8, 6, "candidates"), (9, 6, "kv"), (9, 8, "topk"),
        (10, 6, "kv"), (10, 6, "candidates"), (11, 6, "kv"), (11, 10, "topk"), (12, 11, "dspark_tap")}
    # one Engram marker, before layer 2
    engram = [t for t in fig.data if t.name == "engram"]
    assert len(engram) == 1 and list(engram[0].y) == [1.5]
    assert y_of(12, cfg) > y_of(11, cfg) + 1


def test_hover_names_sources_and_params():
    cfg = release_config()
    plan = role_plan(cfg)
    fig = plan_figure(cfg, plan, layer_params={24: 13_800_000_000})
    hover = blocks(fig).hovertext[24].replace("<br>", " ")
    assert "<b>Layer 24</b> Reindex" in hover and "KV from layer 20" in hover and "top-k from self" in hover
    assert "13.80B parameters" in hover
    # narrow: every line but the bold title at most 14 characters, so the box fits beside the block
    import re
    for text in blocks(fig).hovertext:
        lines = [re.sub(r"<[^>]+>", "", line) for line in text.split("<br>")]
        assert all(len(line) <= 14 for line in lines[1:]), lines
    assert describe_layer(plan[25], cfg) == "KV from layer 20 · top-k from layer 24"
    assert describe_layer(plan[0], cfg).startswith("128-token window only")


def test_selection_ring_and_legend():
    cfg = release_config()
    plan = role_plan(cfg)
    fig = plan_figure(cfg, plan, selected=24)
    ring = [s for s in fig.layout.shapes if s.name == "ring"]
    assert len(ring) == 1 and ring[0].yanchor == 24.0 and ring[0].xanchor == fig.data[-1].x[24]
    assert fig.data == plan_figure(cfg, plan, selected=3).data    # a new selection changes the layout only
    names = next(t for t in fig.data if t.name == "names")
    assert dict(zip(names.y, names.text))[24.0] == "24 Reindex" and "20 Full m=1" in names.text
    assert len(names.text) == sum(r.role in ("full", "reindex") for r in plan[:cfg.n_layers]) + 1   # + DSpark
    counts = {e["tab"]: e["count"] for e in plan_legend(plan)}
    assert counts == {"swa": 2, "full_m2": 3, "full_m1": 1, "reindex": 4, "reuse": 30}


@pytest.mark.parametrize("cfg", [release_config(), small_config()], ids=["release", "small"])
def test_every_plan_edge_is_drawn(cfg):
    fig = plan_figure(cfg)
    arcs = [t for t in fig.data if (t.name or "").startswith("arcs:")]
    drawn = sum(list(t.x).count(None) for t in arcs)     # one None ends each arc
    assert drawn == len(plan_edges(cfg))
