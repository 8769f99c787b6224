"""V4.1-Flash explorer: `streamlit run app.py`. Widget wiring only; figures and view models live in
explorer/, the model in engine/.

Environment: EXPLORER_SOURCE=config|shipped|path picks the default model source (a link's `?source=`
wins), EXPLORER_CHECKPOINT the default checkpoint folder, EXPLORER_CHECKPOINT_ROOT the folders the
checkpoint field may read when the app listens beyond localhost (':'-separated; unset: only
EXPLORER_CHECKPOINT), EXPLORER_DRAFT_DIR where long prompts of links are kept (default: a temp
folder), EXPLORER_TIMING=1 logs each section's server time, EXPLORER_DRAW_OFFSCREEN=1 updates charts
out of sight at once (the bench's baseline).
"""

from __future__ import annotations

import time
from dataclasses import replace

import streamlit as st

from engine.config import ConfigError, load_config
from engine.roles import TAB_TITLES, TABS, role_plan
from engine.tally import cache_breakdown_at
from explorer import dspark_view, kv_view, link, prompt as pr, release_view as rv, session_view as sv
from explorer.diagram import diagram_figure
from explorer.plan import describe_layer, legend_html, plan_figure
from explorer.screens.common import cached_tally, chart, fail, guarded, log_time, set_view, view
from explorer.screens.compare import compare_section
from explorer.screens.live import kernel_parity_panel, live_run, live_views, scroll_if_asked
from explorer.screens.sessions import open_session, session_panel, sessions_sidebar, show_flashes
from explorer.screens.sidebar import sidebar
from explorer.screens.serving_plan import render_serving_plan
from explorer.state import (POSITION_TITLES, POSITIONS, boxes_from_selection, picked_customdata, select_layer,
                            state_from_query)
from explorer.style import fmt_bytes, fmt_params, fmt_tokens
from explorer.tally_view import headline, layer_params, margin_lines, position_total, source_note, tally_figure

st.set_page_config(page_title="V4.1-Flash explorer", layout="wide", initial_sidebar_state="expanded")
st.html("""<style>
  .block-container {padding-top: 2.2rem; padding-bottom: 2rem; max-width: 1800px;}
  h1 {font-size: 1.55rem !important; margin-bottom: 0 !important;}
  h3 {font-size: 1.08rem !important; margin-top: .4rem !important;}
  [data-testid="stMetricValue"] {font-size: 1.5rem;}
  .muted {color: #6B7280; font-size: .85rem;}
  /* the layer views below the fold: the browser skips their style, layout and paint while they are
     out of sight (a click re-renders them all); the last drawn height keeps the scrollbar steady */
  .st-key-live_views [data-testid="stElementContainer"] {content-visibility: auto;
                                                           contain-intrinsic-size: auto 300px;}
</style>""")
TAB_BY_TITLE = {title: tab for tab, title in TAB_TITLES.items()}


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


# -- page sections ------------------------------------------------------------------------------

def plan_column(cfg, plan, tally) -> None:
    st.markdown("### Layer plan")
    st.html(legend_html(plan))
    fig = plan_figure(cfg, plan, layer_params=layer_params(tally), selected=view().layer)
    chart(fig, "plan_chart", tag=f"layer {view().layer}", on_click=lambda points: on_plan_click(points, plan))


def diagram_column(cfg, plan, tally) -> None:
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
            chart(fig, f"diagram_{tab_id}", tag=f"layer {rep}", png=f"diagram_{tab_id}_layer{rep}",
                  on_click=on_diagram_click)
            picked = st.session_state.get("picked_box")
            if picked and picked in stats:
                s = stats[picked]
                st.caption(f"**{picked}** · {s.params:,} params · {s.dtype} · {fmt_bytes(s.bytes)} · "
                           f"tensors {', '.join(s.tensors)} · shapes {', '.join(s.shapes)}")


def tally_column(live_tally, release_tally, live_label: str | None) -> None:
    """The release's tally first; the live model's total beside it (and its rows on request)."""
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
    chart(tally_figure(lines, v.position, highlight=st.session_state.get("highlight_line")), "tally_chart",
          tag=v.position, png=f"tally_{v.position}", on_click=on_tally_click)
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
        chart(kv_view.kv_figure(cfg, n), "kv_chart", tag=str(n), png=f"kv_cache_release_{n}_tokens")
        for line in kv_view.measured_lines(measured) if measured else []:
            st.caption(line)


@st.fragment
def analysis(cfg, plan, tally, source: str, path: str, text: str, span) -> None:
    """Everything that follows the selected layer: plan, diagram, tally, session panel, live views,
    parity, comparison. A click on the plan reruns only this (not the sidebar, KV panel or session
    list), so the new layer's views arrive sooner."""
    started = time.perf_counter()
    log_time("script-started-at")   # a click on the plan reruns this fragment, not the whole script
    if st.session_state.pop("_full_rerun", False):
        st.rerun()   # a session action from in here: the sidebar's list and the messages change too
    show_flashes()
    panel = st.container()
    left, mid, right = st.columns([1.1, 2.45, 1.3], gap="medium")
    with left:
        guarded("Cannot draw the plan", plan_column, cfg, plan, tally)
    with mid:
        guarded("Cannot draw the diagram", diagram_column, cfg, plan, tally)
    with right:
        release_tally = cached_tally(pr.SOURCE_CONFIG, str(pr.RELEASE_CONFIG))
        guarded("Cannot draw the tally", tally_column, tally, release_tally,
                None if source == pr.SOURCE_CONFIG else rv.live_label(source))

    run_started = time.perf_counter()
    run, why = live_run(source, path, text, span, plan)
    log_time("live_run", run_started)
    st.session_state["_analysis"] = dict(view=view(), role=plan[view().layer], source=source, path=path, text=text,
                                         span=span, run=run, origin=st.session_state.get("run_origin"))
    with panel:
        guarded("Cannot show the session", session_panel, source, path)
    st.divider()
    with st.container(key="live_views"):
        guarded("Cannot draw the layer views", live_views, cfg, plan, run, why)
    guarded("Cannot run the kernel parity check", kernel_parity_panel, source, path, text, plan)
    st.divider()
    guarded("Cannot draw the comparison", compare_section, cfg, plan, run, source, path)
    scroll_if_asked()
    linked = link.link_params(source, st.session_state.get("ckpt_path", ""), text, link.draft_dir())
    owned = {**view().to_query(), **linked}
    # only this section's keys are touched: the others may be bound to widgets (plan_open), which
    # st.query_params refuses to set
    for key in ("layer", "tab", "pos", "session", *link.LINK_KEYS):
        if key not in owned and key in st.query_params:
            del st.query_params[key]
    st.query_params.update(owned)
    log_time("analysis", started)
    log_time("script-ended-at")


def main() -> None:
    started = time.perf_counter()
    st.session_state.pop("_full_rerun", None)
    first_load = "view" not in st.session_state
    url_session = st.query_params.get("session")
    if first_load and url_session:
        open_session(url_session)
    source, path, text, span = sidebar()
    try:
        cfg = load_config(path)
        plan = role_plan(cfg)
        tally = cached_tally(source, path)
    except (ConfigError, OSError, ValueError) as err:   # the page still draws, from the release config
        fail("Cannot read the model; the release config is shown", err)
        path = str(pr.RELEASE_CONFIG)
        cfg = load_config(path)
        plan = role_plan(cfg)
        tally = cached_tally(pr.SOURCE_CONFIG, path)

    if "view" not in st.session_state:
        state, problems = state_from_query(st.query_params.to_dict(), plan)
        set_view(state)
        st.session_state["diagram_tab"] = TAB_TITLES[state.tab]
        st.session_state["tally_pos"] = state.position
        for p in problems:
            st.warning(p)
    opened = st.session_state.get("open_session")
    if view().session and (opened is None or opened.id != view().session):
        set_view(sv.with_session(view(), None))     # a link to a session that did not open
    if st.session_state.pop("_restore_view", False) and opened is not None:
        restored, problems = sv.view_from_session(opened, plan, opened.id)
        if first_load and "layer" in st.query_params:    # an explicit layer in the link wins
            restored = sv.with_session(view(), opened.id)
        set_view(restored)
        st.session_state["diagram_tab"] = TAB_TITLES[restored.tab]
        st.session_state["tally_pos"] = restored.position
        for p in problems:
            st.warning(p)
    if view().layer >= len(plan):      # a smaller model after a source change
        set_view(replace(view(), layer=0, tab=plan[0].tab))
        st.session_state["diagram_tab"] = TAB_TITLES[plan[0].tab]

    st.title("DeepSeek-V4.1-Flash explorer")
    head = rv.headline(load_config(pr.RELEASE_CONFIG), cached_tally(pr.SOURCE_CONFIG, str(pr.RELEASE_CONFIG)),
                       None if source == pr.SOURCE_CONFIG else cfg, tally, source)
    st.markdown(f"<span class='release-head'>{head.release}</span>" +
                (f"<br><span class='muted'>{head.live}</span>" if head.live else ""), unsafe_allow_html=True)
    analysis(cfg, plan, tally, source, path, text, span)
    st.divider()
    guarded("Cannot draw the KV panel", kv_panel, cfg, st.session_state.get("_analysis", {}).get("run"), source)
    guarded("Cannot draw the serving plan", render_serving_plan, cfg,
            st.session_state.get("_analysis", {}).get("run"))
    guarded("Cannot show the sessions", sessions_sidebar)
    log_time("script", started)


main()
