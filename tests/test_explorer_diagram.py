"""The block diagram: which boxes each role tab draws, and that their figures come from the tally."""

from __future__ import annotations

import pytest

from engine.config import release_config
from engine.roles import TABS, role_plan
from engine.tally import tally_from_config
from explorer.diagram import ANCHOR_MHC, ANCHOR_ROUTING, ANCHOR_TOPK, _arrows, diagram_boxes, diagram_figure
from explorer.style import fmt_params
from explorer.tally_view import box_stats, representative_layer

CFG = release_config()
PLAN = role_plan(CFG)
TALLY = tally_from_config(CFG)


def ids(tab, layer=None):
    return {b.id for b in diagram_boxes(CFG, tab, PLAN[layer] if layer is not None else None)}


def test_role_specific_boxes():
    common = {"hc_attn", "attn_norm", "wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "window", "attn_core", "attn_sink",
              "wo_a", "wo_b", "hc_attn_post", "hc_ffn", "ffn_norm", "gate", "experts", "shared_experts", "hc_ffn_post"}
    for tab in TABS:
        assert common <= ids(tab), tab
    assert {"compressor_wkv", "compressor_wgate", "indexer_wk", "indexer_wq_b", "global_kv"} <= ids("full_m2")
    assert "compressor_wgate" not in ids("full_m1") and "compressor_wkv" in ids("full_m1")
    assert {"indexer_wq_b", "indexer_weights_proj", "borrowed_keys", "borrowed_kv"} <= ids("reindex")
    assert not {"indexer_wk", "compressor_wkv"} & ids("reindex")
    assert "borrowed_topk" in ids("reuse") and not {b for b in ids("reuse") if b.startswith("indexer")}
    assert "no_global" in ids("swa") and not {"borrowed_kv", "topk_select"} & ids("swa")
    assert "engram" in ids("swa", 1) and "engram" not in ids("swa", 0)
    with pytest.raises(ValueError):
        diagram_boxes(CFG, "nope")


def test_borrowed_boxes_name_their_sources():
    labels = {b.id: b.label for b in diagram_boxes(CFG, "reuse", PLAN[29])}
    assert labels["borrowed_topk"] == "top-k of layer 28" and labels["borrowed_kv"] == "KV cache of layer 20"
    labels = {b.id: b.label for b in diagram_boxes(CFG, "reindex", PLAN[24])}
    assert labels["borrowed_keys"] == "index keys of layer 20"


@pytest.mark.parametrize("tab", TABS)
def test_every_weight_box_shows_its_tally(tab):
    layer = representative_layer(tab, PLAN, None)
    stats = box_stats(TALLY, layer)
    fig = diagram_figure(CFG, tab, stats, role=PLAN[layer])
    labels = next(t for t in fig.data if t.name == "labels")
    assert "no tally" not in " ".join(labels.text)
    boxes = diagram_boxes(CFG, tab, PLAN[layer])
    for box, x, y, text in zip(boxes, labels.x, labels.y, labels.text, strict=True):
        assert (x, y) == (box.cx, box.cy) and box.label in text       # each label sits on its box
        if box.kind == "weight":   # the dtype too where it fits (always in the hover)
            assert f"({fmt_params(stats[box.id].params)}" in text, box.id
    wide = {b.id: t for b, t in zip(boxes, labels.text) if b.x1 - b.x0 > 30 and b.kind == "weight"}
    assert all(f" {stats[i].dtype})" in t for i, t in wide.items())
    # narrow boxes (cmp.wkv, idx.wq_b, w_proj: ~10 of 97 units) drop the dtype, and shrink if need be
    sizes = {b.id: size for b, size in zip(boxes, labels.textfont["size"])}
    assert max(sizes.values()) == 11 and min(sizes.values()) >= 8
    if tab == "full_m2":   # 'cmp.wgate' (9 characters) in 9.6 units: ~56 px, too narrow for 11 px bold
        assert sizes["compressor_wgate"] < 11 and "(2.62M)" in labels.text[[b.id for b in boxes].index(
            "compressor_wgate")]
    # one arrow per edge: a segment (start, end, gap) with a head on its end only
    arrows = next(t for t in fig.data if t.name == "arrows")
    assert len(arrows.x) == 3 * len(_arrows(boxes)) and arrows.x[2::3] == [None] * len(_arrows(boxes))
    assert arrows.marker["size"][1::3] == [8] * len(_arrows(boxes)) and not any(arrows.marker["size"][0::3])
    assert fig.data[-1].name == "boxes"       # the click targets stay on top


def test_click_targets_and_highlight():
    stats = box_stats(TALLY, 24)
    fig = diagram_figure(CFG, "reindex", stats, role=PLAN[24], highlight={"wq_b"})
    targets = fig.data[-1]
    anchors = {d[0]: d[1] for d in targets.customdata}
    assert anchors["indexer_wq_b"] == ANCHOR_TOPK and anchors["hc_attn"] == ANCHOR_MHC
    assert anchors["experts"] == ANCHOR_ROUTING and anchors["wq_a"] == ""
    assert set(anchors) == ids("reindex", 24)
    hover = [h for d, h in zip(targets.customdata, targets.hovertext) if d[0] == "experts"][0]
    assert "FLOPs per token" in hover and "2304×5120 ×384" in hover
    filled = [s for s in fig.layout.shapes if s.type == "rect" and s.fillcolor == "#F0E442"]
    assert len(filled) == 1
