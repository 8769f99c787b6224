"""The side by side: the run on screen (A) against a saved session or another prompt (B) at the
selected layer."""

from __future__ import annotations

import traceback

import streamlit as st

from explorer import chart_titles as ct, run_plan, session_view as sv, token_align
from explorer.screens.common import cached_engine, cpu_refusal, named_chart, run_cached, view
from explorer.screens.sessions import cached_store
from explorer.session_compare import CompareError, compare_layer
from explorer.sessions import SessionError


def compare_section(cfg, plan, run: dict | None, source: str, path: str) -> None:
    """Two runs at the selected layer: the one on screen (A) and a saved session or another prompt (B)."""
    r = plan[view().layer]
    st.markdown(f"### Side by side at layer {r.layer}",
                help="Which KV entries each query selected and which experts each token was routed to, in run A "
                     "(on screen) and run B; blue only in A, orange only in B, grey in both.")
    if run is None:
        st.caption("Needs a run on screen (A): load model weights, or open a session.")
        return
    # nothing is compared until asked: a comparison of a long prompt is heavy and often not wanted
    mode = st.radio("Compare with", ["off", "session", "prompt"], key="cmp_mode", horizontal=True,
                    format_func={"off": "nothing", "session": "a saved session", "prompt": "another prompt"}.get)
    run_b, label_b = None, "B"
    if mode == "off":
        return
    store, why = cached_store()
    if mode == "session":
        if store is None:
            st.caption(sv.md_escape(f"Saved sessions are unavailable: {why}"))
            return
        opened = st.session_state.get("open_session")
        try:
            choices = sv.compare_choices(store.list_sessions(f"layer:{r.layer}", limit=50),
                                         opened.id if opened else None)
        except SessionError as err:
            st.error(sv.md_escape(str(err)))
            return
        if not choices:
            st.caption(f"No other saved session is at layer {r.layer}.")
            return
        pick = st.selectbox("Session B", list(choices), format_func=choices.get, key="cmp_session", index=None,
                            placeholder="Pick a session to compare with")
        if pick is None:
            return
        try:
            other = store.load(pick)
        except SessionError as err:
            st.warning(sv.md_escape(str(err)))
            return
        run_b, label_b = other.probes, other.name
    else:
        text_b = st.text_area("Prompt B", key="cmp_prompt", height=90)
        folder = run_plan.weights_folder(source, path)
        if folder is None:
            st.caption("Running prompt B needs model weights (pick the shipped model or a checkpoint folder).")
            return
        clicked = st.button("Run prompt B", key="cmp_run")
        if clicked and not text_b.strip():
            st.warning("Type prompt B first.")
        elif clicked and cpu_refusal(source, path):
            st.info(cpu_refusal(source, path))
        elif clicked:
            try:
                engine = cached_engine(str(folder))
                st.session_state["cmp_run_b"] = (text_b, run_cached(engine.identity, str(folder), text_b,
                                                                    tuple(sv.looked_at_layers(r)), ()))
            except Exception as err:
                print(traceback.format_exc())
                st.error(sv.md_escape(f"The run of prompt B failed: {err}"))
        held = st.session_state.get("cmp_run_b")
        if held and held[0] == text_b:
            run_b, label_b = held[1], "prompt B"
    if run_b is None:
        return
    try:
        cmp = compare_layer(run, run_b, r.layer)
    except CompareError as err:
        st.warning(sv.md_escape(str(err)))
        return
    st.caption(f"A: what is on screen · B: {sv.md_escape(label_b)}")
    aligned_section(run, run_b, r.layer)
    for line in sv.comparison_summary(cmp):
        st.markdown(f"- {sv.md_escape(line)}")
    a, b = st.columns(2)
    model, text = ct.model_label(source, path), (st.session_state.get("_analysis") or {}).get("text")
    for kind, column, has in (("selections", a, cmp.has_selections), ("routing", b, cmp.has_routing)):
        if has:
            with column:
                named_chart(sv.comparison_figure(cmp, kind), f"cmp_{kind}",
                            ct.comparison_name(model, kind, label_b, r.layer, text), width=ct.HALF_WIDTH)
    rows = sv.comparison_rows(cmp, only_differences=True)
    if rows:
        st.dataframe(rows, hide_index=True, height=min(320, 38 + 35 * len(rows)))
    else:
        st.caption("No position differs.")


def aligned_section(run: dict, run_b: dict, layer: int) -> None:
    """Two different prompts: align their tokens first (explorer/token_align.py), so an edit does not
    shift every later position; the position-by-position lines follow."""
    if run.get("tokens") == run_b.get("tokens"):
        return
    try:
        aligned = token_align.aligned_selections(run, run_b, layer)
    except token_align.AlignError as err:
        st.caption(sv.md_escape(f"No token-aligned comparison: {err}"))
        return
    with st.container(key="cmp_aligned"):
        st.markdown("**Aligned by tokens:** " + sv.md_escape(" ".join(token_align.aligned_summary(aligned))))
        edits = token_align.edits_text(aligned.alignment, list(run["tokens"]), list(run_b["tokens"]))
        if edits:
            st.caption(sv.md_escape("Edits: " + "; ".join(edits)))
        st.caption("Position by position (no alignment):")
