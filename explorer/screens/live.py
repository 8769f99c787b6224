"""The selected layer on the prompt: the run (or why none), the top-k, mHC and routing views, and
the kernel parity check."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import streamlit as st

from explorer import dspark_view, glossary as gl, layer_views as lv, remote, run_plan, session_view as sv
from explorer import run_warnings as rw
from explorer.screens import selections as sx
from explorer.selection_view import STORED_BEFORE_NUMERICS
from explorer.screens.serving_prefill import serving_prefill_section
from explorer.screens.common import cached_engine, chart, cpu_refusal, fail, run_cached, view

ANCHORS = {"topk": "topk", "mhc": "mhc", "routing": "routing"}
PARITY_ROWS = 16   # tokens per kernel call compared under the CPU interpreter


@st.fragment
def live_views(cfg, plan, run: dict | None, why_no_run: str | None) -> None:
    """The selected layer on the prompt. A fragment: picking a query token does not redraw the page."""
    r = plan[view().layer]
    st.markdown(f"## {dspark_view.stage_heading(r, cfg) if r.is_dspark else lv.layer_heading(r)}")
    st.markdown(f"<span class='muted'>{lv.layer_subheading(r, cfg)}</span>", unsafe_allow_html=True)
    for line in run_captions(run) if run is not None else ():   # how the run was computed
        st.caption(line)
    probe = None
    if run is None:
        st.info(why_no_run or "No run yet.")
    else:
        try:
            probe = lv.layer_probe(run, r.layer)
        except lv.ProbeError as err:
            fail("The run's probes are malformed", err)
    bad = rw.nonfinite_warning(probe, r.layer, (st.session_state.get("run_origin") or {}).get("nonfinite_weights", ()))
    if run is not None and bad:
        st.warning(bad, icon=":material/warning:")
    tokens = (run or {}).get("tokens") or []
    q = sx.query_slider(len(tokens)) if probe is not None and tokens else None
    serving_prefill_section(cfg, r)  # decoder layers: the serving note and the CED-vs-full switch

    st.subheader("Top-k selections", anchor=ANCHORS["topk"])
    note = lv.global_branch_note(r, cfg)
    if note:
        st.caption(note)
    if probe is None and r.kv_source is not None:
        st.caption("After a run: query position × global entry (window band and candidate pool marked), the prompt "
                   "shaded by how often each token was selected, and one query's picks highlighted in the text.")
    if probe is not None and r.kv_source is not None:
        try:
            source_probe = lv.layer_probe(run, r.index_source) if r.role == "reuse" else probe
            model = lv.topk_model(run, source_probe) if source_probe else None
            if model is None:
                st.caption("The run recorded no top-k for this layer.")
            else:
                sx.titled_chart(lv.topk_figure(model, query=q), "topk_map", "top-k selections", r.layer, q,
                                tag=f"layer {r.layer}", on_click=sx.on_map_click)
                st.caption(gl.CAPTIONS["topk_map"])
                st.caption(f"{gl.CAPTIONS['token_strip']} Query {q}: {tokens[q]!r}.")
                sx.strip(tokens, lv.selection_counts(model), q, lv.selected_positions(model, q),
                         lv.image_mask(run, probe), r.layer)
                if source_probe.get("topk_scores") is not None:
                    sx.scores_section(r, run, probe, source_probe, tokens, q)
        except lv.ProbeError as err:
            fail("Cannot draw the top-k view", err)

    st.subheader("mHC coefficients", anchor=ANCHORS["mhc"])
    if probe is not None and probe.get("mhc"):
        try:
            sx.titled_chart(lv.mhc_token_figure(probe, q), "mhc_token", "mHC weights of one token", r.layer, q,
                            tag=f"layer {r.layer}")
            st.caption(f"{gl.CAPTIONS['mhc_token']} Token {q}: {tokens[q]!r} (the query above).")
            sx.titled_chart(lv.side_by_side(lv.mhc_lines_figure(probe, tokens, "attn"),
                                            lv.residual_norms_figure(probe, tokens), share=0.5),
                            "mhc_lines", "mHC weights across the prompt", r.layer, tag=f"layer {r.layer}")
            st.caption(gl.CAPTIONS["mhc_lines"])
        except lv.ProbeError as err:
            fail("Cannot draw the mHC view", err)
    elif probe is not None:
        st.caption("The run recorded no mHC coefficients for this layer.")
    else:
        st.caption("After a run: one token's pre/post weights and its two 4×4 comb mixes, the coefficients across "
                   "tokens, and the norms of the residual copies.")

    st.subheader("Expert routing", anchor=ANCHORS["routing"])
    if probe is None:
        st.caption("After a run: token × expert weights, expert load (text vs image tokens), and each token's "
                   "top-k experts; the shared expert runs on every token.")
    else:
        try:
            n_routed, n_active = cfg.experts_of(r.layer)
            model = lv.routing_model(run, probe, n_routed)
            if model is None:
                st.caption("The run recorded no routing for this layer.")
            else:
                split = lv.bias_split(model)
                st.caption(f"Top-{n_active} of {n_routed} routed experts per token plus the always-on shared expert. "
                           f"{split['text_tokens']} text tokens (bias) use {split['text_experts']} experts; "
                           f"{split['image_tokens']} image tokens (bias_vl) use {split['image_experts']}.")
                sx.titled_chart(lv.side_by_side(lv.routing_heatmap(model, tokens, colorbar_x=0.49),
                                                lv.expert_load_figure(model), gap=0.14),
                                "routing_map", "expert routing", r.layer, tag=f"layer {r.layer}")
                st.caption(gl.CAPTIONS["routing_map"])
                sx.routing_margin_section(r, probe, q, n_active)
                # built only when opened: a table re-drawn on every click cost more than it showed
                routes = st.expander("Each token's routed experts (table)", key="routes_table", on_change="rerun")
                if routes.open:
                    routes.dataframe(lv.token_routes(model, tokens), hide_index=True, height=240)
        except lv.ProbeError as err:
            fail("Cannot draw the routing view", err)

    if probe is not None:
        c1, c2 = st.columns(2)
        # built on click only: a long prompt's probes are megabytes
        name = sx.names("probes", r.layer)[0]
        c1.download_button("Download layer JSON", lambda: lv.layer_json(run, r.layer), f"{name}.json",
                           "application/json", on_click="ignore")
        c2.download_button("Download layer CSV", lambda: lv.layer_csv(run, r.layer), f"{name}.csv",
                           "text/csv", on_click="ignore")
    sx.glossary_expander()


def run_captions(run: dict) -> list[str]:
    """The captions that say how a run (live, stored or loaded) was computed: its numerics (engine/ops)
    and, for a CED prefill (engine/run/ced.py), the replay its decoder ran on."""
    numerics = run.get("numerics") or STORED_BEFORE_NUMERICS
    why = {"reference": " (the official reference's bf16 dtype flow)", "fp32": " (float32 between ops)"}.get(numerics, "")
    lines = [f"Numerics: {numerics}{why}" + ("; the run was stored before runs named their numerics"
                                            if not run.get("numerics") else "")]
    if run.get("prefill") == "ced":
        replay, n = run.get("replay"), len(run.get("tokens") or [])
        if not isinstance(replay, int) or isinstance(replay, bool):
            lines.append("Prefill: ced (the run does not say its replay)")
        elif replay >= n:
            lines.append(f"Prefill: ced, replay {replay}: it covers the whole {n}-token prompt, so the decoder "
                         "layers ran on every prompt token (the same as the full prefill)")
        else:
            lines.append(f"Prefill: ced, replay {replay}: the decoder layers ran on the last {replay} of the {n} "
                         f"prompt tokens only (positions {n - replay}-{n - 1}); the encoder on all of them")
    return lines


def kernel_parity_panel(source: str, path: str, text: str, plan) -> None:
    """'Kernel parity': each Triton kernel against its PyTorch reference on the selected layer's real
    inputs (engine/run/parity.py layer_parity), on a button press; the table shows the differences."""
    r = plan[view().layer]
    box = st.expander("Kernel parity", key="parity_box", on_change="rerun")
    if not box.open:    # built only when opened (it loads the engine and tokenizes the prompt)
        return
    with box:
        blocker = run_plan.parity_blocker(source, path, text, r, remote=bool(remote.engine_url()))
        if blocker:
            st.caption(blocker)
            return
        from engine.run import parity as kpath
        from engine.run.api import EngineError
        try:
            engine = cached_engine(str(Path(path)))
            n_tokens = len(engine.encode(text))
        except Exception as err:   # EngineError messages are written for users
            st.caption(f"No check: {err}")
            return
        mode, why = lv.parity_mode(engine.device.type == "cuda", run_plan.interpreter_possible(kpath.interpreter_active()),
                                   kpath.interpreter_cost(engine, n_tokens, PARITY_ROWS), kpath.INTERPRETER_LIMIT,
                                   PARITY_ROWS)
        st.caption(why)
        if mode == "none":
            return
        key = (engine.identity, text, r.layer)
        if st.button(f"Check the kernels on layer {r.layer}", key="parity_run"):
            try:
                if mode == "interpreter":
                    kpath.enable_interpreter()
                with st.spinner(f"Running the prompt and comparing layer {r.layer}'s kernels…"):
                    rows = kpath.layer_parity(engine, text, r.layer, max_rows=None if mode == "cuda" else PARITY_ROWS)
                st.session_state["parity_result"] = (key, rows)
            except (kpath.KernelPathError, EngineError) as err:
                st.warning(f"The check could not run: {err}")
        got = st.session_state.get("parity_result")
        if got is not None and got[0] == key:
            rows = got[1]
            st.markdown(lv.parity_summary(rows))
            st.dataframe(lv.parity_table(rows), hide_index=True, column_order=lv.PARITY_COLUMNS)


def live_run(source: str, path: str, text: str, span, plan) -> tuple[dict | None, str | None]:
    """Run the selected layer (and the layer whose top-k it borrows) on the prompt, or say why not.
    EXPLORER_RUN_JSON names a saved run (`engine.api.save_result`) to show instead of running."""
    st.session_state["run_origin"] = None
    saved = os.environ.get("EXPLORER_RUN_JSON")
    stored = sv.stored_run(st.session_state.get("open_session"), plan[view().layer], text, span)
    if stored is not None and not saved:
        opened = st.session_state["open_session"]
        st.session_state["run_origin"] = {"identity": opened.model_identity, "source": opened.model_source,
                                          "engine_version": opened.engine_version, "stored": True}
        return stored, None
    if saved:
        try:
            return json.loads(Path(saved).read_text()), None
        except (OSError, ValueError) as err:
            return None, f"Cannot read the saved run {saved}: {err}"
    r = plan[view().layer]
    why = run_plan.why_no_run(source, path, text, r, remote=bool(remote.engine_url()))
    if why:
        return None, why
    refusal = cpu_refusal(source, path)
    if refusal:
        return None, refusal
    try:
        engine = cached_engine(str(Path(path)))
        origin = {"identity": engine.identity, "source": engine.source, "stored": False}
        st.session_state["run_origin"] = origin
        run = run_cached(engine.identity, str(Path(path)), text, run_plan.probe_layers(r), (span,) if span else ())
        origin["nonfinite_weights"] = nonfinite_weights(engine)   # filled as the run read them
        return run, None
    except Exception as err:   # the engine's messages are written for users (EngineError)
        print(traceback.format_exc())
        return None, f"The run failed: {err}"


def nonfinite_weights(engine) -> list[str]:
    """The weights the engine's checkpoint reader found holding NaN or inf (none known for a remote engine)."""
    reader = getattr(getattr(getattr(engine, "model", None), "weights", None), "reader", None)
    return list(getattr(reader, "nonfinite", None) or [])


def scroll_if_asked() -> None:
    target = st.session_state.pop("scroll_to", None)
    if target in ANCHORS.values():
        st.html(f"<script>setTimeout(() => window.parent.document.getElementById('{target}')"
                f"?.scrollIntoView({{behavior: 'smooth'}}), 300)</script>", unsafe_allow_javascript=True)
