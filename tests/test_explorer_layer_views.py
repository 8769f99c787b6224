"""Live layer view models on a synthetic run shaped like `RunResult.to_json()`."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from engine.config import release_config
from engine.roles import role_plan
from explorer import layer_views as lv
from explorer_synth import synthetic_layer, synthetic_run

CFG = release_config()
PLAN = role_plan(CFG)


def tiny_run():
    """T=6, ratio 2: entries 0..2 cover tokens (0,1), (2,3), (4,5)."""
    layer = synthetic_layer(6, ratio=2, k=2, n_experts=8, top=2)
    layer["topk"] = [[-1, -1], [0, -1], [0, -1], [0, 1], [1, -1], [0, 2]]
    layer["candidate_pool"] = [[], [0], [0], [0, 1], [0, 1], [0, 1, 2]]
    layer["routing"]["experts"] = [[0, 1], [0, 2], [0, 1], [3, 1], [0, 7], [0, 1]]
    layer["routing"]["weights"] = [[1.0, 0.5]] * 6
    image = [False, False, True, True, False, False]
    layer["routing"]["image_mask"] = image
    return synthetic_run(6, {8: layer}, image=image)


def test_headings():
    assert lv.layer_heading(PLAN[24]) == "Layer 24 · Reindex"
    assert lv.layer_subheading(PLAN[25], CFG) == "KV from layer 20 · top-k from layer 24"
    assert "no global branch" in lv.layer_subheading(PLAN[0], CFG)
    assert "no global branch" in lv.global_branch_note(PLAN[1], CFG)
    assert "layer 24 chose" in lv.global_branch_note(PLAN[25], CFG)
    assert lv.global_branch_note(PLAN[24], CFG) is None


def test_topk_counts_and_token_mapping():
    run = tiny_run()
    m = lv.topk_model(run, lv.layer_probe(run, 8))
    assert (m.T, m.ratio, m.n_entries) == (6, 2, 3)
    # entry 0 picked by queries 1, 2, 3, 5 (4 times), entry 1 by 3 and 4, entry 2 by 5
    assert lv.selection_counts(m) == [4, 4, 2, 2, 1, 1]
    assert lv.selected_positions(m, 5) == {0, 1, 4, 5}
    assert lv.selected_positions(m, 0) == set()
    with pytest.raises(lv.ProbeError):
        lv.selected_positions(m, 6)
    binned = lv.topk_map(m)
    assert binned["sel"][3] == [1.0, 1.0, 0.0] and binned["pool"][5] == [1.0, 1.0, 1.0]
    fig = lv.topk_figure(m, query=5)
    assert any(t.name == "window" for t in fig.data)


def test_topk_map_bins_large_prompts():
    T = 1000
    run = synthetic_run(T, {24: synthetic_layer(T, k=8, seed=3)})
    m = lv.topk_model(run, lv.layer_probe(run, 24))
    binned = lv.topk_map(m)
    assert len(binned["sel"]) <= lv.MAX_MAP_CELLS and len(binned["sel"][0]) <= lv.MAX_MAP_CELLS
    # binning keeps the total count of selections (weights are 1 / cells per bin)
    total = sum(map(sum, binned["sel"])) * binned["q_bin"] * binned["e_bin"]
    assert round(total) == sum(len(r) for r in m.selected)


def test_token_strip_escapes_and_marks():
    html_text = lv.token_strip_html(["<b>", "a"], [0, 1], highlight={0}, focus=1, image=[True, False])
    assert "&lt;b&gt;" in html_text and "<b>" not in html_text
    assert "box-shadow" in html_text and "outline" in html_text and "dashed" in html_text


def test_mhc_views():
    run = tiny_run()
    probe = lv.layer_probe(run, 8)
    coeff = lv.mhc_token(probe, 3)
    assert set(coeff) == {"attn", "ffn"} and len(coeff["attn"]["comb"]) == 4
    assert coeff["attn"]["pre"] == probe["mhc"]["attn"]["pre"][3]
    fig = lv.mhc_token_figure(probe, 3)
    assert sum(1 for t in fig.data if t.type == "heatmap") == 2
    assert len(lv.mhc_lines_figure(probe, run["tokens"]).data) == 8     # pre and post for 4 copies
    assert len(lv.residual_norms_figure(probe, run["tokens"]).data) == 4
    with pytest.raises(lv.ProbeError):
        lv.mhc_token(probe, 6)


def test_routing_views():
    run = tiny_run()
    model = lv.routing_model(run, lv.layer_probe(run, 8), 8)
    assert model.load() == [5, 4, 1, 1, 0, 0, 0, 1]
    assert model.load(image=True) == [1, 2, 0, 1, 0, 0, 0, 0]
    assert model.matrix()[4][7] == 0.5 and model.matrix()[4][1] == 0.0
    split = lv.bias_split(model)
    assert split == {"text_tokens": 4, "image_tokens": 2, "text_experts": 4, "image_experts": 3,
                     "shared_experts_used": 2}
    routes = lv.token_routes(model, run["tokens"])
    assert routes[3]["experts"] == "3:1.000 1:0.500" and routes[2]["image"] is True
    fig = lv.expert_load_figure(model)
    assert [t.name for t in fig.data] == ["text tokens (bias)", "image tokens (bias_vl)"]


def test_downloads():
    run = tiny_run()
    rows = list(csv.DictReader(io.StringIO(lv.layer_csv(run, 8))))
    assert len(rows) == 6 and rows[5]["topk_entries"] == "0 2" and rows[2]["image"] == "1"
    assert rows[0]["topk_entries"] == ""
    data = json.loads(lv.layer_json(run, 8))
    assert data["layer"] == 8 and data["topk"][5] == [0, 2]
    with pytest.raises(lv.ProbeError):
        lv.layer_csv(run, 9)


def test_malformed_probes_raise_clear_errors():
    run = tiny_run()
    probe = lv.layer_probe(run, 8)
    probe["topk"] = probe["topk"][:3]
    with pytest.raises(lv.ProbeError, match="'topk' has 3 rows for 6 tokens"):
        lv.topk_model(run, probe)
    with pytest.raises(lv.ProbeError, match="no 'layers'"):
        lv.layer_probe({"tokens": []}, 1)
    assert lv.layer_probe(None, 1) is None


def test_long_prompt_views_ship_compact_figures():
    # a 1,000-token prompt: routing rows averaged into at most MAX_MAP_CELLS bins (means checked by
    # hand), per-token lines carry the token texts once, numbers travel as binary blocks
    T = 1000
    run = synthetic_run(T, {24: synthetic_layer(T, k=8, n_experts=32, seed=1)})
    probe = lv.layer_probe(run, 24)
    model = lv.routing_model(run, probe, 32)
    heat = lv.routing_heatmap(model, run["tokens"]).data[0]
    z, full = np.asarray(heat.z), np.asarray(model.matrix())
    per = -(-T // lv.MAX_MAP_CELLS)
    assert z.shape == (-(-T // per), 32) and list(heat.y[:2]) == [0, per]
    assert np.allclose(z[1], full[per:2 * per].mean(0)) and np.allclose(z[-1], full[(len(z) - 1) * per:].mean(0))
    # the hover names each bin's token range: customdata per cell, the bin's last token (the last bin short)
    ends = np.asarray(heat.customdata)
    assert ends.shape == z.shape and (ends[:, 0] == ends[:, -1]).all()
    assert ends[0, 0] == per - 1 and ends[-1, 0] == T - 1 and "tokens %{y}-%{customdata}" in heat.hovertemplate
    lines = lv.mhc_lines_figure(probe, run["tokens"])
    assert list(lines.data[0].customdata) == run["tokens"] and all(t.customdata is None for t in lines.data[1:])
    assert np.allclose(np.asarray(lines.data[0].y), [row[0] for row in probe["mhc"]["attn"]["pre"]], atol=1e-6)
    for fig in (lines, lv.residual_norms_figure(probe, run["tokens"]), lv.routing_heatmap(model, run["tokens"]),
                lv.topk_figure(lv.topk_model(run, probe), query=T - 1)):
        assert '"bdata"' in fig.to_json()


def test_side_by_side_keeps_both_panels():
    run = tiny_run()
    probe = lv.layer_probe(run, 8)
    model = lv.routing_model(run, probe, 8)
    left, right = lv.routing_heatmap(model, run["tokens"]), lv.expert_load_figure(model)
    both = lv.side_by_side(left, right, share=0.6)
    assert len(both.data) == len(left.data) + len(right.data)
    assert [t.xaxis for t in both.data[len(left.data):]] == ["x2"] * len(right.data)
    assert [t.yaxis for t in both.data[len(left.data):]] == ["y2"] * len(right.data)
    assert both.layout.xaxis.domain[1] < both.layout.xaxis2.domain[0]   # no overlap
    assert both.layout.yaxis.autorange == "reversed"                    # the heatmap's tokens run down
    assert both.layout.xaxis2.title.text == right.layout.xaxis.title.text
    assert both.layout.showlegend and both.layout.height == max(left.layout.height, right.layout.height)
    assert list(both.data[-1].y) == list(right.data[-1].y)
