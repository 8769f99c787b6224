"""The tally margin and the diagram's parentheticals against the tally and hand computation."""

from __future__ import annotations

from fractions import Fraction

import pytest

from engine.config import release_config
from engine.roles import role_plan
from engine.tally import tally_from_config
from explorer.state import POSITIONS
from explorer.tally_view import (BOX_KINDS, box_stats, layer_params, line_of, margin_lines, position_total,
                                 representative_layer, row_value, tally_figure)
from test_explorer_plan import small_config

RELEASE = tally_from_config(release_config())
SMALL = tally_from_config(small_config())


@pytest.mark.parametrize("tally", [RELEASE, SMALL], ids=["release", "small"])
@pytest.mark.parametrize("position", POSITIONS)
def test_margin_lines_sum_to_the_shown_total(tally, position):
    lines = margin_lines(tally, position)
    shown = position_total(tally, position)
    assert sum(Fraction(l.value) for l in lines) == Fraction(shown)
    # and every tally row lands in exactly one line
    assert sum(row_value(r, position) for r in tally.rows) == Fraction(shown)
    fig = tally_figure(lines, position)
    values = fig.data[1].x
    assert list(values) == [float(l.value) for l in lines]
    assert [list(c) for c in fig.data[0].customdata] == [["|".join(l.boxes), l.id] for l in lines]
    # each row's name and figures start at the left edge, above its bar (beside it, they ran off the chart)
    labels = fig.data[2]
    assert list(labels.x) == [0] * len(lines) and labels.textposition == "top right"
    assert [t.split(" · ")[0] for t in labels.text] == [l.title for l in lines]
    assert fig.layout.xaxis["range"][1] == pytest.approx(max(values) * 1.02)


def test_release_margin_against_spec_figures():
    lines = {l.id: l for l in margin_lines(RELEASE, "total")}
    assert lines["experts"].value == 543_581_798_400           # spec section 6
    assert lines["engram_tables"].value == 196_613_849_600
    assert lines["experts"].boxes == ("experts",)
    assert set(lines["q_path"].boxes) == {"wq_a", "q_norm", "wq_b"}
    assert lines["head"].boxes == ()                            # not drawn in the block diagram
    assert abs(position_total(RELEASE, "decode") - 16.1e9) < 0.05e9
    assert abs(position_total(RELEASE, "prefill") - 7.9e9) < 0.05e9
    # lines are ordered largest first
    values = [float(l.value) for l in margin_lines(RELEASE, "decode")]
    assert values == sorted(values, reverse=True)


def test_box_stats_by_hand():
    s = box_stats(RELEASE, 24)
    assert s["wq_b"].params == 64 * 512 * 1280 and s["wq_b"].dtype == "FP8"
    assert s["experts"].params == 384 * 3 * 2304 * 5120 and s["experts"].dtype == "FP4"
    assert s["experts"].active_params == 6 * 3 * 2304 * 5120
    assert s["experts"].flops_per_token == 2 * 6 * 3 * 2304 * 5120
    assert s["hc_attn"].params == 24 * 20480 + 24 + 3
    assert s["gate"].params == 384 * 5120 + 384 + 384
    assert s["indexer_wq_b"].params == 32 * 128 * 1280
    assert s["attn_norm"].flops_per_token == 0                 # a norm is not a matmul
    # a Reindex layer owns only the indexer's query side (spec: +5.41 M)
    extras = s["indexer_wq_b"].params + s["indexer_weights_proj"].params
    assert round(extras / 1e6, 2) == 5.41
    assert "compressor_wkv" not in s and "indexer_wk" not in s
    full2 = box_stats(RELEASE, 2)
    m2 = sum(full2[b].params for b in ("compressor_wkv", "compressor_wgate", "compressor_norm", "indexer_wk",
                                       "indexer_k_norm", "indexer_wq_b", "indexer_weights_proj"))
    assert round(m2 / 1e6, 2) == 10.72
    assert "compressor_wgate" not in box_stats(RELEASE, 20)
    assert box_stats(RELEASE, 1)["engram"].active_params == 3 * 8 * 256 + 25600 * 6144 + 2 * 4 * 5120


def test_every_backbone_kind_has_a_box():
    kinds = {r.box for r in RELEASE.rows if r.layers}
    assert kinds <= {k for ks in BOX_KINDS.values() for k in ks}


def test_layer_params_and_lines():
    params = layer_params(RELEASE)
    assert len(params) == 40
    # a Reuse layer: attention path + MoE + mHC + norms, no extras; Reindex adds exactly the indexer queries
    assert params[24] - params[25] == 32 * 128 * 1280 + 32 * 5120
    assert {line_of(r) for r in RELEASE.rows} >= {"experts", "dspark", "vision", "head", "embed"}


def test_representative_layer():
    plan = role_plan(release_config())
    assert representative_layer("reindex", plan, 28) == 28
    assert representative_layer("reindex", plan, 3) == 24
    assert representative_layer("full_m2", plan, 24) == 2
    assert representative_layer("swa", plan, 41) == 0
