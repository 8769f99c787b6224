"""A DSpark stage's heading and block diagram are its own (explorer/dspark_view.py)."""

from __future__ import annotations


import pytest

from engine.config import release_config
from engine.roles import TAB_TITLES, role_plan
from engine.tally import tally_from_config
from explorer import dspark_view as dv
from explorer.diagram import diagram_figure


@pytest.fixture(scope="module")
def release():
    cfg = release_config()
    return cfg, role_plan(cfg), tally_from_config(cfg)


def test_stage_heading_and_config(release):
    cfg, plan, _ = release
    assert [dv.stage_heading(plan[i], cfg) for i in (40, 42)] == [
        "DSpark stage 0 (mtp.0) · window-only draft block",
        "DSpark stage 2 (mtp.2) · window-only draft block"]
    drawn = dv.stage_config(cfg, plan[41])
    assert (drawn.n_routed_experts, drawn.n_activated_experts) == (128, 3)    # the release's DSpark MoE
    assert (cfg.n_routed_experts, cfg.n_activated_experts) == (384, 6)        # the backbone's, unchanged


def test_stage_diagram_draws_the_stage_not_layer_0(release):
    cfg, plan, tally = release
    layer, role, drawn, stats, note = dv.diagram_subject(cfg, plan, tally, "swa", 41, TAB_TITLES)
    assert layer == 41 and role.is_dspark and note.startswith("DSpark stage 1 (mtp.1")
    # per stage: 128 routed experts x three 2304x5120 matrices (hand count), one shared expert, a 128-way gate
    assert stats["experts"].params == 128 * 3 * 2304 * 5120
    assert stats["shared_experts"].params == 3 * 2304 * 5120
    assert stats["gate"].params == 128 * 5120 + 128 + 128
    text = diagram_figure(drawn, "swa", stats, role=role).to_json()
    assert "routed experts · 3 of 128" in text and "6 of 384" not in text
    # a backbone layer in the same tab is still drawn from the backbone's figures
    layer, role, drawn, stats, note = dv.diagram_subject(cfg, plan, tally, "swa", 24, TAB_TITLES)
    assert layer == 0 and note == "layer 0, the first SWA-only layer" and drawn is cfg
    assert stats["experts"].params == 384 * 3 * 2304 * 5120
