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
from engine.roles import TAB_TITLES, role_plan
from explorer import chart_titles as ct, link, prompt as pr, release_view as rv, session_view as sv
from explorer.screens.common import cached_tally, fail, guarded, log_time, set_view, view
from explorer.screens.compare import compare_section
from explorer.screens.live import kernel_parity_panel, live_run, live_views, scroll_if_asked
from explorer.screens.page import diagram_column, kv_panel, page_style, plan_column, tally_column
from explorer.screens.sessions import open_session, session_panel, sessions_sidebar, show_flashes
from explorer.screens.sidebar import sidebar
from explorer.screens.serving_plan import render_serving_plan
from explorer.state import state_from_query

st.set_page_config(page_title="V4.1-Flash explorer", layout="wide", initial_sidebar_state="expanded")
page_style()


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
        guarded("Cannot draw the diagram", diagram_column, cfg, plan, tally, ct.model_label(source, path))
    with right:
        release_tally = cached_tally(pr.SOURCE_CONFIG, str(pr.RELEASE_CONFIG))
        guarded("Cannot draw the tally", tally_column, tally, release_tally,
                None if source == pr.SOURCE_CONFIG else rv.live_label(source), ct.model_label(source, path))

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
