"""The page's first sections: the layer plan, the block diagram, the parameter tally and the KV panel,
the callbacks their clicks run, and the page's CSS. app.py wires them; figures come from explorer/."""

from __future__ import annotations

from dataclasses import replace

import streamlit as st

from engine.config import load_config
from engine.roles import TAB_TITLES, TABS
from engine.tally import cache_breakdown_at
from explorer import chart_titles as ct, dspark_view, kv_view, prompt as pr, release_view as rv
from explorer.diagram import diagram_figure
from explorer.plan import describe_layer, legend_html, plan_figure
from explorer.screens.common import chart, named_chart, set_view, view
from explorer.state import POSITION_TITLES, POSITIONS, boxes_from_selection, picked_customdata, select_layer
from explorer.style import fmt_bytes, fmt_params, fmt_tokens
from explorer.tally_view import headline, layer_params, margin_lines, position_total, source_note, tally_figure

PAGE_CSS = """<style>
  .block-container {padding-top: 2.2rem; padding-bottom: 2rem; max-width: 1800px;}
  h1 {font-size: 1.55rem !important; margin-bottom: 0 !important;}
  h3 {font-size: 1.08rem !important; margin-top: .4rem !important;}
  [data-testid="stMetricValue"] {font-size: 1.5rem;}
  .muted {color: #6B7280; font-size: .85rem;}
  /* the layer views below the fold: the browser skips their style, layout and paint while they are
     out of sight (a click re-renders them all); the last drawn height keeps the scrollbar steady */
  .st-key-live_views [data-testid="stElementContainer"] {content-visibility: auto;
                                                           contain-intrinsic-size: auto 300px;}
</style>"""
TAB_BY_TITLE = {title: tab for tab, title in TAB_TITLES.items()}


def page_style() -> None:
    st.html(PAGE_CSS)


def on_plan_click(points: list, plan) -> None:
    new = select_layer(view(), points, plan)
    if new != view():
        set_view(new)
        st.session_state["diagram_tab"] = TAB_TITLES[new.tab]
        st.session_state["highlight"] = []


def on_tab_change() -> None:
    title = st.session_state.get("diagram_tab")
    if title in TAB_BY_TITLE:
        set_view(replace(view(), tab=TAB_BY_TITLE[title]))


def on_position_change() -> None:
    set_view(replace(view(), position=st.session_state["tally_pos"]))


def on_tally_click(points: list) -> None:
    picked = picked_customdata(points)
    st.session_state["highlight"] = boxes_from_selection(points)
    st.session_state["highlight_line"] = picked[-1][1] if picked and len(picked[-1]) > 1 else None


def on_diagram_click(points: list) -> None:
    picked = picked_customdata(points)
    if picked:
        st.session_state["picked_box"] = picked[-1][0]
        st.session_state["scroll_to"] = picked[-1][1] or None


# -- sections -----------------------------------------------------------------------------------

def plan_column(cfg, plan, tally) -> None:
    st.markdown("### Layer plan")
    st.html(legend_html(plan))
    fig = plan_figure(cfg, plan, layer_params=layer_params(tally), selected=view().layer)
    chart(fig, "plan_chart", tag=f"layer {view().layer}", on_click=lambda points: on_plan_click(points, plan))


def diagram_column(cfg, plan, tally, model: str) -> None:
    """One tab per diagram role; `model` names the drawn model in the chart's title and PNG name."""
    v = view()
    st.markdown("### Block diagram")
    st.session_state.setdefault("diagram_tab", TAB_TITLES[v.tab])
    tabs = st.tabs([TAB_TITLES[t] for t in TABS], key="diagram_tab", on_change=on_tab_change)
    highlight = set(st.session_state.get("highlight") or [])
    for tab_id, container in zip(TABS, tabs):
        if not container.open:
            continue
        with container:
            subject = dspark_view.diagram_subject(cfg, plan, tally, tab_id, v.layer, TAB_TITLES)
            if subject is None:
                st.info(f"No layer of this model is {TAB_TITLES[tab_id]}.")
                continue
            rep, r, drawn_cfg, stats, note = subject
            st.caption(f"Drawn for {note}: {describe_layer(r, cfg)}. Grey: parameters and storage dtype from the "
                       "tally; hover for shapes, bytes and FLOPs per token; click the indexer, mHC or MoE boxes to jump "
                       "to their live view.")
            fig = diagram_figure(drawn_cfg, tab_id, stats, role=r, highlight=highlight)
            named_chart(fig, f"diagram_{tab_id}", ct.diagram_name(model, tab_id, TAB_TITLES[tab_id], r, drawn_cfg),
                        tag=f"layer {rep}", on_click=on_diagram_click)
            picked = st.session_state.get("picked_box")
            if picked and picked in stats:
                s = stats[picked]
                st.caption(f"**{picked}** · {s.params:,} params · {s.dtype} · {fmt_bytes(s.bytes)} · "
                           f"tensors {', '.join(s.tensors)} · shapes {', '.join(s.shapes)}")


def tally_column(live_tally, release_tally, live_label: str | None, live_model: str) -> None:
    """The release's tally first; the live model's total beside it (and its rows on request). The
    chart's title and PNG name say whose rows it shows (`live_model` names the live ones)."""
    v = view()
    st.markdown("### Parameter tally")
    st.session_state.setdefault("tally_pos", v.position)
    st.radio("Position", POSITIONS, key="tally_pos", format_func=POSITION_TITLES.get, on_change=on_position_change,
             label_visibility="collapsed")
    c1, c2 = st.columns(2)
    c1.metric(f"Release · {POSITION_TITLES[v.position]}", fmt_params(position_total(release_tally, v.position)),
              help=f"{position_total(release_tally, v.position):,} parameters (release config)")
    if live_label:
        c2.metric(live_label, fmt_params(position_total(live_tally, v.position)),
                  help=f"{position_total(live_tally, v.position):,} parameters")
    shown = st.radio("Rows of", ["release", "live"], key="tally_of", horizontal=True, label_visibility="collapsed",
                     format_func={"release": "the release", "live": live_label or "live model"}.get) \
        if live_label else "release"
    tally = release_tally if shown == "release" else live_tally
    lines = margin_lines(tally, v.position)
    name = ct.tally_name(ct.RELEASE_MODEL if shown == "release" else live_model, v.position,
                         POSITION_TITLES[v.position])
    named_chart(tally_figure(lines, v.position, highlight=st.session_state.get("highlight_line")), "tally_chart",
                name, tag=v.position, on_click=on_tally_click)
    st.caption(f"{headline(tally, v.position)} = the sum of the rows. {source_note(tally)} "
               "Click a row to outline its boxes in the diagram.")
    if st.session_state.get("highlight"):
        st.button("Clear highlight", on_click=lambda: st.session_state.update(highlight=[], highlight_line=None))


def kv_panel(live_cfg, run: dict | None, source: str) -> None:
    """The release's KV cache first; the live model's beside it in the table."""
    cfg = load_config(pr.RELEASE_CONFIG)
    st.markdown("### KV cache", help="Global KV per token, the bounded windows, and the cache at a chosen length "
                                     "(release config; the live model in the table beside).")
    left, right = st.columns([1, 1.4], gap="large")
    with left:
        st.markdown(kv_view.kv_explainer(cfg))
        st.dataframe(kv_view.kv_table(cfg), hide_index=True, width="stretch")
        st.caption(kv_view.window_note(cfg))
    with right:
        n = st.select_slider("Context length", options=kv_view.CONTEXT_CHOICES, value=1_000_000,
                             format_func=fmt_tokens, key="context_len")
        at = cache_breakdown_at(cfg, n)
        c1, c2, c3 = st.columns(3)
        c1.metric("Global KV + index keys", fmt_bytes(at["global_kv"] + at["index_keys"]))
        c2.metric("Windows", fmt_bytes(at["windows"]))
        c3.metric("Total cache", fmt_bytes(at["total"]))
        live = None if source == pr.SOURCE_CONFIG else live_cfg
        st.dataframe(rv.kv_compare(cfg, live, n), hide_index=True, width="stretch")
        measured = kv_view.measured_vs_formula(live_cfg, run)
        named_chart(kv_view.kv_figure(cfg, n), "kv_chart", ct.kv_name(n), tag=str(n))
        for line in kv_view.measured_lines(measured) if measured else []:
            st.caption(line)
