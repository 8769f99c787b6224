"""A DSpark draft stage on its own terms: its heading, the config its block diagram is drawn from
(the stage's own routed experts, e.g. 3 of 128, not the backbone's 6 of 384) and its boxes' figures
from the tally's `dspark.*` rows. Pure (no Streamlit)."""

from __future__ import annotations

from dataclasses import replace

from engine.config import ModelConfig
from engine.roles import LayerRole
from engine.tally import Tally

from .tally_view import BoxStat, box_stats, representative_layer

PREFIX = "dspark."


def stage_number(r: LayerRole, cfg: ModelConfig) -> int:
    """0-based, as the checkpoint names the stages (mtp.0 .. mtp.2) and the plan marks them."""
    return r.layer - cfg.n_layers


def stage_heading(r: LayerRole, cfg: ModelConfig) -> str:
    k = stage_number(r, cfg)
    return f"DSpark stage {k} (mtp.{k}) · window-only draft block"


def stage_config(cfg: ModelConfig, r: LayerRole) -> ModelConfig:
    """The config a stage's block diagram reads: its own routed and activated expert counts."""
    routed, active = cfg.experts_of(r.layer)
    return cfg.replace(n_routed_experts=routed, n_activated_experts=active)


def stage_box_stats(tally: Tally, cfg: ModelConfig, r: LayerRole) -> dict[str, BoxStat]:
    """Each diagram box's figures for one DSpark stage: the `dspark.*` rows shared by the stages read
    as if they were backbone rows of the stage layers (the blocks are alike; the counts differ)."""
    stages = list(range(cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers))
    rows = [replace(row, box=row.box[len(PREFIX):], layers=stages) for row in tally.rows
            if row.box.startswith(PREFIX) and row.instances % len(stages) == 0]
    return box_stats(replace(tally, rows=rows), r.layer)


def diagram_subject(cfg: ModelConfig, plan: list[LayerRole], tally: Tally, tab: str, selected: int,
                    titles: dict[str, str]):
    """What one diagram tab draws: (layer, role, config, box stats, note), or None when no layer of
    the model has this tab's role. A selected DSpark stage is drawn in its own tab (SWA) as itself;
    otherwise the tab draws the selected layer if it is of that role, else the role's first layer."""
    r = plan[selected]
    if r.is_dspark and r.tab == tab:
        return selected, r, stage_config(cfg, r), stage_box_stats(tally, cfg, r), stage_heading(r, cfg)
    rep = representative_layer(tab, plan, selected)
    if rep is None:
        return None
    note = "the selected layer" if rep == selected else f"layer {rep}, the first {titles[tab]} layer"
    return rep, plan[rep], cfg, box_stats(tally, rep), note
