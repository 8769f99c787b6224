"""V4.1-Flash explorer: `streamlit run app.py`. Widget wiring only; figures and view models live in
explorer/, the model in engine/.

Environment: EXPLORER_SOURCE=config|shipped|path picks the default model source (also `?source=`),
EXPLORER_CHECKPOINT the default checkpoint folder, EXPLORER_TIMING=1 logs each section's server time.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import replace
from pathlib import Path

import streamlit as st

from engine.config import ConfigError, load_config
from engine.roles import TAB_TITLES, TABS, role_plan
from engine.tally import cache_breakdown_at, tally_from_config
from explorer import kv_view, layer_views as lv, prompt as pr, remote, session_view as sv
from explorer.session_compare import CompareError, compare_layer, replay_report
from explorer.components import html_block, plotly_chart, png_config
from explorer.diagram import diagram_figure
from explorer.plan import describe_layer, legend_html, plan_figure
from explorer.state import (POSITION_TITLES, POSITIONS, ViewState, boxes_from_selection, picked_customdata,
                            select_layer, state_from_query)
from explorer.sessions import (SessionConflict, SessionError, SessionNotFound, SessionStore,
                               StoreUnavailable)
from explorer.style import fmt_bytes, fmt_params, fmt_tokens
from explorer.tally_view import (box_stats, headline, layer_params, margin_lines, position_total,
                                 representative_layer, source_note, tally_figure)

st.set_page_config(page_title="V4.1-Flash explorer", layout="wide", initial_sidebar_state="expanded")
st.html("""<style>
  .block-container {padding-top: 2.2rem; padding-bottom: 2rem; max-width: 1800px;}
  h1 {font-size: 1.55rem !important; margin-bottom: 0 !important;}
  h3 {font-size: 1.08rem !important; margin-top: .4rem !important;}
  [data-testid="stMetricValue"] {font-size: 1.5rem;}
  .muted {color: #6B7280; font-size: .85rem;}
</style>""")
TAB_BY_TITLE = {title: tab for tab, title in TAB_TITLES.items()}
PLOT_CONFIG = {"displayModeBar": False, "scrollZoom": False}
STATIC_DIR = Path(__file__).resolve().parent / "static"   # plotly.js is served from here (no CDN)


def chart(fig, key: str, *, tag: str = "", png: str | None = None, on_click=None) -> None:
    """One Plotly chart, kept mounted across reruns and updated in place (explorer/components);
    `png` names the file its mode-bar button downloads."""
    config = png_config(png, PLOT_CONFIG) if png else PLOT_CONFIG
    plotly_chart(fig, key=key, static_dir=STATIC_DIR, tag=tag, config=config, on_click=on_click)


def guarded(what: str, section, *args) -> None:
    """Draw one section; a failure becomes a message there, and the rest of the page still draws.
    EXPLORER_TIMING=1 logs each section's server time (benches/ui.py reads it)."""
    started = time.perf_counter()
    try:
        section(*args)
    except Exception as err:
        fail(what, err)
    log_time(section.__name__, started)


def log_time(what: str, started: float | None = None) -> None:
    """EXPLORER_TIMING=1: a section's server time since `started` (ms), or a wall-clock mark (s)."""
    if not os.environ.get("EXPLORER_TIMING"):
        return
    if started is None:
        print(f"[timing] {what} {time.time():.3f} s", flush=True)
    else:
        print(f"[timing] {what} {1000 * (time.perf_counter() - started):.1f} ms", flush=True)


def fail(what: str, err: Exception) -> None:
    """A user-facing error: one clear line, the traceback only in the server log."""
    print(traceback.format_exc())
    st.error(f"{what}: {err}")


# -- model source (sidebar) ---------------------------------------------------------------------

@st.cache_resource(show_spinner="Reading the tally…")
def cached_tally(source: str, path: str):
    from engine.tally import tally_from_checkpoint
    if source == pr.SOURCE_CONFIG or not any(Path(path).glob("*.safetensors")):
        return tally_from_config(load_config(path))
    return tally_from_checkpoint(path)


@st.cache_resource(show_spinner="Loading the model…")
def cached_engine(path: str):
    from engine.api import load
    return remote.attached_engine() or load(path)   # one shared engine; its run() holds a lock


def sidebar():
    """Model source and prompt. Returns (source, cfg_path, prompt text, image span or None)."""
    st.sidebar.markdown("### Model")
    default = os.environ.get("EXPLORER_SOURCE") or st.query_params.get("source") or pr.SOURCE_SHIPPED
    options = [pr.SOURCE_SHIPPED, pr.SOURCE_PATH, pr.SOURCE_CONFIG]
    if "source" not in st.session_state:
        st.session_state["source"] = default if default in options else pr.SOURCE_SHIPPED
    source = st.sidebar.radio("Source", options, key="source", format_func=pr.SOURCE_TITLES.get,
                              label_visibility="collapsed")
    path = ""
    if source == pr.SOURCE_SHIPPED:
        path = str(pr.MODEL_DIR)
        if not (pr.MODEL_DIR / "config.json").exists():
            st.sidebar.info("The shipped small model is not in assets/model yet: plan, diagram and tallies use the "
                            "release config; live views need weights.")
            path = str(pr.RELEASE_CONFIG)
    elif source == pr.SOURCE_PATH:
        st.session_state.setdefault("ckpt_path", os.environ.get("EXPLORER_CHECKPOINT", ""))
        path = st.sidebar.text_input("Checkpoint folder", key="ckpt_path", placeholder="/data/v41-flash", help="A release-layout folder: config.json, "
                                     "model.safetensors.index.json and its shards.").strip()
        if not path:
            st.sidebar.caption("Enter a folder; until then the release config is shown.")
            path = str(pr.RELEASE_CONFIG)
    else:
        path = str(pr.RELEASE_CONFIG)
        st.sidebar.caption("Plan, diagram and tallies from assets/configs/v41-flash.json. No weights are loaded.")

    st.sidebar.markdown("### Prompt")
    samples = pr.sample_prompts()
    titles = {s.id: s.title for s in samples}
    pick = st.sidebar.selectbox("Sample", [s.id for s in samples], format_func=titles.get, key="sample",
                                on_change=lambda: st.session_state.update(
                                    prompt_text=next(s.text for s in samples if s.id == st.session_state["sample"])))
    if "prompt_text" not in st.session_state:
        st.session_state["prompt_text"] = next((s.text for s in samples if s.id == pick), "")
    upload = st.sidebar.file_uploader("…or upload a text file", type=["txt", "md", "py", "json", "csv"],
                                      key="upload")
    if upload is not None and st.session_state.get("_uploaded") != upload.file_id:
        try:
            st.session_state["prompt_text"] = pr.decode_upload(upload.name, upload.getvalue())
            st.session_state["_uploaded"] = upload.file_id
        except pr.PromptError as err:
            st.sidebar.error(str(err))
    text = st.sidebar.text_area("Prompt text", key="prompt_text", height=220)
    n_tokens, span = 0, None
    try:
        tok_path = str(Path(path) / "tokenizer.json") if (Path(path) / "tokenizer.json").exists() else None
        ids, _ = pr.tokenize(text, tok_path) if text.strip() else ([], [])
        n_tokens = len(ids)
        st.sidebar.caption(f"**{n_tokens:,} tokens** (with BOS) · "
                           f"{'checkpoint' if tok_path else 'project'} tokenizer")
    except Exception as err:  # a broken tokenizer file must not take the page down
        fail("Could not tokenize the prompt", err)
    if st.sidebar.checkbox("Mark a token span as image positions", key="image_on",
                           help="Those positions route with the gate's bias_vl instead of bias."):
        raw = st.sidebar.text_input("Image span (start-end, end exclusive)", key="image_span",
                                    placeholder=f"e.g. 10-{min(40, max(n_tokens, 11))}")
        try:
            span = pr.parse_span(raw, n_tokens)
        except pr.PromptError as err:
            st.sidebar.error(str(err))
    return source, path, text, span


# -- state and callbacks ------------------------------------------------------------------------

def view() -> ViewState:
    return st.session_state["view"]


def set_view(new: ViewState) -> None:
    st.session_state["view"] = new


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
            rep = representative_layer(tab_id, plan, v.layer)
            if rep is None:
                st.info(f"No layer of this model is {TAB_TITLES[tab_id]}.")
                continue
            r = plan[rep]
            stats = box_stats(tally, rep)
            note = "the selected layer" if rep == v.layer else f"layer {rep}, the first {TAB_TITLES[tab_id]} layer"
            st.caption(f"Drawn for {note}: {describe_layer(r, cfg)}. Grey: parameters and storage dtype from the "
                       "tally; hover for shapes, bytes and FLOPs per token; click the indexer, mHC or MoE boxes to jump "
                       "to their live view.")
            fig = diagram_figure(cfg, tab_id, stats, role=r, highlight=highlight)
            chart(fig, f"diagram_{tab_id}", tag=f"layer {rep}", png=f"diagram_{tab_id}_layer{rep}",
                  on_click=on_diagram_click)
            picked = st.session_state.get("picked_box")
            if picked and picked in stats:
                s = stats[picked]
                st.caption(f"**{picked}** · {s.params:,} params · {s.dtype} · {fmt_bytes(s.bytes)} · "
                           f"tensors {', '.join(s.tensors)} · shapes {', '.join(s.shapes)}")


def tally_column(tally) -> None:
    v = view()
    st.markdown("### Parameter tally")
    st.session_state.setdefault("tally_pos", v.position)
    st.radio("Position", POSITIONS, key="tally_pos", format_func=POSITION_TITLES.get, on_change=on_position_change,
             label_visibility="collapsed")
    lines = margin_lines(tally, v.position)
    st.metric(POSITION_TITLES[v.position], fmt_params(position_total(tally, v.position)),
              help=f"{position_total(tally, v.position):,} parameters")
    chart(tally_figure(lines, v.position, highlight=st.session_state.get("highlight_line")), "tally_chart",
          tag=v.position, png=f"tally_{v.position}", on_click=on_tally_click)
    st.caption(f"{headline(tally, v.position)} = the sum of the rows. {source_note(tally)} "
               "Click a row to outline its boxes in the diagram.")
    if st.session_state.get("highlight"):
        st.button("Clear highlight", on_click=lambda: st.session_state.update(highlight=[], highlight_line=None))


def kv_panel(cfg, run: dict | None) -> None:
    st.markdown("### KV cache", help="Global KV per token, the bounded windows, and the cache at a chosen length.")
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
        measured = kv_view.measured_vs_formula(cfg, run)
        chart(kv_view.kv_figure(cfg, n, measured=measured), "kv_chart", tag=str(n), png=f"kv_cache_{n}_tokens")
        if measured:
            st.caption(f"After the run ({measured['context_len']:,} tokens): the engine held "
                       f"{measured['total']:,} B; the formula gives {measured['formula_total']:,} B.")


@st.fragment
def live_views(cfg, plan, run: dict | None, why_no_run: str | None) -> None:
    """The selected layer on the prompt. A fragment: picking a query token does not redraw the page."""
    r = plan[view().layer]
    st.markdown(f"## {lv.layer_heading(r)}")
    st.markdown(f"<span class='muted'>{lv.layer_subheading(r, cfg)}</span>", unsafe_allow_html=True)
    probe = None
    if run is None:
        st.info(why_no_run or "No run yet.")
    else:
        try:
            probe = lv.layer_probe(run, r.layer)
        except lv.ProbeError as err:
            fail("The run's probes are malformed", err)
    tokens = (run or {}).get("tokens") or []

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
                q = st.slider("Query token", 0, model.T - 1, model.T - 1, key="query_pos")
                chart(lv.topk_figure(model, query=q), "topk_map", tag=f"layer {r.layer}", png=f"layer{r.layer}_topk")
                st.caption("Token strip: shade = how often each token's entry was selected; ringed = the entries "
                           f"query {q} ({tokens[q]!r}) selected.")
                html_block(lv.token_strip_html(tokens, lv.selection_counts(model), focus=q,
                                               highlight=lv.selected_positions(model, q), image=lv.image_mask(run, probe)),
                           key="token_strip", tag=f"layer {r.layer}")
        except lv.ProbeError as err:
            fail("Cannot draw the top-k view", err)

    st.subheader("mHC coefficients", anchor=ANCHORS["mhc"])
    if probe is not None and probe.get("mhc"):
        try:
            t = st.slider("Token", 0, len(tokens) - 1, len(tokens) - 1, key="mhc_pos")
            chart(lv.mhc_token_figure(probe, t), "mhc_token", tag=f"layer {r.layer}", png=f"layer{r.layer}_mhc_token{t}")
            chart(lv.side_by_side(lv.mhc_lines_figure(probe, tokens, "attn"), lv.residual_norms_figure(probe, tokens),
                                  share=0.5), "mhc_lines", tag=f"layer {r.layer}", png=f"layer{r.layer}_mhc_lines")
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
                chart(lv.side_by_side(lv.routing_heatmap(model, tokens), lv.expert_load_figure(model)), "routing_map",
                      tag=f"layer {r.layer}", png=f"layer{r.layer}_routing")
                st.dataframe(lv.token_routes(model, tokens), hide_index=True, height=240)
        except lv.ProbeError as err:
            fail("Cannot draw the routing view", err)

    if probe is not None:
        c1, c2 = st.columns(2)
        # built on click only: a long prompt's probes are megabytes
        c1.download_button("Download layer JSON", lambda: lv.layer_json(run, r.layer), f"layer{r.layer}.json",
                           "application/json", on_click="ignore")
        c2.download_button("Download layer CSV", lambda: lv.layer_csv(run, r.layer), f"layer{r.layer}.csv",
                           "text/csv", on_click="ignore")


ANCHORS = {"topk": "topk", "mhc": "mhc", "routing": "routing"}
PARITY_ROWS = 16   # tokens per kernel call compared under the CPU interpreter


def kernel_parity_panel(source: str, path: str, text: str, plan) -> None:
    """'Kernel parity': each Triton kernel against its PyTorch reference on the selected layer's real
    inputs (engine/kernel_path.py layer_parity), on a button press; the table shows the differences."""
    r = plan[view().layer]
    with st.expander("Kernel parity"):
        folder = Path(path)
        if source == pr.SOURCE_CONFIG or remote.engine_url() or r.is_dspark or not text.strip() \
                or not (folder.is_dir() and any(folder.glob("*.safetensors"))):
            st.caption("Needs a prompt, a local checkpoint folder (not a remote engine) and a model layer "
                       "(DSpark stages are not run).")
            return
        import sys
        from engine import kernel_path as kpath
        from engine.api import EngineError
        try:
            engine = cached_engine(str(folder))
            n_tokens = len(engine.encode(text))
        except Exception as err:   # EngineError messages are written for users
            st.caption(f"No check: {err}")
            return
        interp = kpath.interpreter_active() or "kernels.sparse_attn" not in sys.modules
        mode, why = lv.parity_mode(engine.device.type == "cuda", interp,
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
    if source == pr.SOURCE_CONFIG:
        return None, "Config only: no weights are loaded, so there are no live views. Pick the shipped model or a " \
                     "checkpoint folder in the sidebar."
    folder = Path(path)
    if not (folder.is_dir() and any(folder.glob("*.safetensors"))) and not remote.engine_url():
        return None, f"No weights at {folder}: live views need a checkpoint with safetensors shards."
    if not text.strip():
        return None, "The prompt is empty."
    r = plan[view().layer]
    if r.is_dspark:
        return None, "DSpark stages are counted, not run, by this engine."
    layers = tuple(sorted({r.layer} | ({r.index_source} if r.index_source is not None else set())))
    refusal = cpu_refusal(source, path)
    if refusal:
        return None, refusal
    try:
        engine = cached_engine(str(folder))
        st.session_state["run_origin"] = {"identity": engine.identity, "source": engine.source, "stored": False}
        return run_cached(engine.identity, str(folder), text, layers, (span,) if span else ()), None
    except Exception as err:   # the engine's messages are written for users (EngineError)
        print(traceback.format_exc())
        return None, f"The run failed: {err}"


def cpu_refusal(source: str, path: str) -> str | None:
    """Why this model is not run in this process (too big for a CPU), or None."""
    if remote.engine_url():
        return None
    return lv.cpu_run_refusal(cached_tally(source, path).active_decode_params, on_cpu=True)


@st.cache_resource(show_spinner="Running the prompt through all layers…", max_entries=8)
def prompt_run(identity: str, folder: str, text: str, spans: tuple):
    """One run per prompt with every layer probed, shared read-only: another layer is a lookup."""
    return cached_engine(folder).run(text, image_spans=list(spans))


@st.cache_resource(show_spinner=False, max_entries=16)
def run_cached(identity: str, folder: str, text: str, layers: tuple, spans: tuple) -> dict:
    """The prompt's run as JSON with these layers' probes (read-only, shared): going back to a layer
    costs a lookup."""
    return prompt_run(identity, folder, text, spans).to_json(layers=list(layers))


def scroll_if_asked() -> None:
    target = st.session_state.pop("scroll_to", None)
    if target in ANCHORS.values():
        st.html(f"<script>setTimeout(() => window.parent.document.getElementById('{target}')"
                f"?.scrollIntoView({{behavior: 'smooth'}}), 300)</script>", unsafe_allow_javascript=True)


# -- sessions -----------------------------------------------------------------------------------

@st.cache_resource(show_spinner="Opening the session database…")
def open_store(db_url: str, db_path: str):
    """(store, None), or (None, why): one store per database and process. A failure is remembered
    until "Retry", so a dead database server does not stall every rerun."""
    try:
        return SessionStore.from_env({"EXPLORER_DB_URL": db_url, "EXPLORER_DB_PATH": db_path}), None
    except SessionError as err:
        return None, str(err)
    except Exception as err:   # a missing driver or the like: still one line for the user
        print(traceback.format_exc())
        return None, f"The session database cannot be opened: {err}"


def cached_store():
    """The store named by EXPLORER_DB_URL (PostgreSQL) or EXPLORER_DB_PATH (SQLite; default path)."""
    return open_store(os.environ.get("EXPLORER_DB_URL", ""), os.environ.get("EXPLORER_DB_PATH", ""))


def flash(kind: str, text: str) -> None:
    """A message for the top of the page on the next draw (callbacks run before the page)."""
    st.session_state.setdefault("session_msgs", []).append((kind, text))
    redraw_page()


def redraw_page() -> None:
    """After a session action from inside the `analysis` fragment: draw the whole page next (the
    sidebar's session list, the messages), not only the fragment."""
    st.session_state["_full_rerun"] = True


def show_session(session) -> None:
    """Put a session's prompt, marks and settings into the widgets; its layer and tab follow in
    main() once the plan is known."""
    st.session_state["open_session"] = session
    st.session_state.update(sv.widget_state(session))
    values, note = sv.source_state(session, lambda folder: Path(folder).is_dir())
    st.session_state.update(values)
    if note:
        flash("info", note)
    st.session_state["_restore_view"] = True
    redraw_page()
    for key in ("replay", "_confirm_delete"):
        st.session_state.pop(key, None)


def open_session(session_id: str) -> None:
    store, why = cached_store()
    if store is None:
        flash("error", f"Cannot open the session: {why}")
        return
    try:
        show_session(store.load(session_id))
    except SessionNotFound as err:
        flash("warning", f"{err} The current view is unchanged.")
    except SessionError as err:
        flash("error", f"Cannot open the session: {err}")


def close_session() -> None:
    redraw_page()
    st.session_state.pop("open_session", None)
    st.session_state.pop("replay", None)
    set_view(sv.with_session(view(), None))


def current_data(name: str, author: str, notes: str):
    """SessionData of what is on screen (stashed by main() on every draw)."""
    a = st.session_state["_analysis"]
    origin = a["origin"] or {}
    return sv.build_session_data(
        name=name, author=author, notes=notes, view=a["view"], role=a["role"], source_kind=a["source"],
        model_source=origin.get("source") or a["path"], model_identity=origin.get("identity", ""),
        engine_version=origin.get("engine_version", ""), prompt=a["text"], span=a["span"],
        settings={k: st.session_state.get(k) for k in sv.SETTING_KEYS}, run=a["run"],
        prompt_b=st.session_state.get("cmp_prompt") if st.session_state.get("cmp_mode") == "prompt" else None)


def on_save() -> None:
    store, why = cached_store()
    try:
        data = current_data(st.session_state.get("save_name", ""), st.session_state.get("save_author", ""),
                            st.session_state.get("save_notes", ""))
        if store is None:
            raise StoreUnavailable(why)
        saved = store.save(data)
    except StoreUnavailable as err:
        flash("error", f"Not saved: {err} Export the analysis as JSON from the sidebar instead.")
        return
    except SessionError as err:
        flash("error", f"Not saved: {err}")
        return
    st.session_state["open_session"] = saved
    set_view(sv.with_session(view(), saved.id))
    flash("success", f"Saved session “{saved.name}”. Share the link below.")


def on_import() -> None:
    upload = st.session_state.get("session_import")
    if upload is None:
        return
    session, problem = sv.import_upload(cached_store()[0], upload.name, upload.getvalue())
    if problem:
        flash("error", problem)
        return
    show_session(session)
    flash("success", f"Imported “{session.name}” as a new session.")


def on_edit(session_id: str, revision: int) -> None:
    store, _ = cached_store()
    try:
        session = store.update(session_id, expected_revision=revision, name=st.session_state.get("edit_name", ""),
                               notes=st.session_state.get("edit_notes", ""))
    except SessionConflict as err:
        flash("warning", str(err))
        session = None
    except SessionError as err:
        flash("error", f"Not changed: {err}")
        return
    if session is None:
        try:
            session = store.load(session_id)
        except SessionError as err:
            flash("error", str(err))
            return
    else:
        flash("success", "Saved the name and notes.")
    st.session_state["open_session"] = session


def on_duplicate(session_id: str) -> None:
    store, _ = cached_store()
    try:
        copy = store.duplicate(session_id)
    except SessionError as err:
        flash("error", f"Not duplicated: {err}")
        return
    show_session(copy)
    flash("success", f"Made a copy: “{copy.name}” (its own link).")


def on_delete(session_id: str) -> None:
    store, _ = cached_store()
    try:
        store.delete(session_id)
    except SessionError as err:
        flash("error", f"Not deleted: {err}")
        return
    name = st.session_state["open_session"].name
    close_session()
    st.session_state["_deleted"] = (session_id, name)


def on_undo_delete() -> None:
    session_id, _ = st.session_state.pop("_deleted")
    store, _ = cached_store()
    try:
        show_session(store.restore(session_id))
    except SessionError as err:
        flash("error", f"Cannot restore: {err}")


def show_flashes() -> None:
    for kind, text in st.session_state.pop("session_msgs", []):
        getattr(st, kind)(sv.md_escape(text))     # messages quote names, ids and files: user text
    deleted = st.session_state.get("_deleted")
    if deleted:
        a, b = st.columns([5, 1])
        a.info(sv.md_escape(f"Deleted the session “{deleted[1]}”; its link no longer opens."))
        b.button("Undo delete", on_click=on_undo_delete, key="undo_delete")


def weights_folder(source: str, path: str) -> Path | None:
    folder = Path(path)
    if source == pr.SOURCE_CONFIG or not (folder.is_dir() and any(folder.glob("*.safetensors"))):
        return None
    return folder


def replay(session, source: str, path: str) -> None:
    """Re-run the stored prompt on the loaded model and keep the report for this session."""
    folder = weights_folder(source, path)
    if folder is None:
        st.info("Replay needs model weights: pick the shipped model or a checkpoint folder in the sidebar.")
        return
    if not session.probes or not session.prompts:
        st.info("This session stored no probes, so there is nothing to replay against.")
        return
    span = sv.image_span(session.spans)
    refusal = cpu_refusal(source, path)
    if refusal:
        st.info(refusal)
        return
    try:
        engine = cached_engine(str(folder))
        with st.spinner("Replaying the stored prompt…"):
            new = engine.run(session.prompts[0], layers=sv.replay_layers(session),
                             image_spans=[span] if span else []).to_json()
    except Exception as err:   # EngineError messages are written for users
        print(traceback.format_exc())
        st.error(sv.md_escape(f"The replay failed: {err}"))
        return
    st.session_state["replay"] = (session.id, sv.replay_view(replay_report(session.probes, new)),
                                  sv.identity_note(session, engine.identity))


def session_panel(source: str, path: str) -> None:
    """The open session: who and what, its share link, and its actions (main page, under the title)."""
    session = st.session_state.get("open_session")
    if session is None:
        return
    with st.container(border=True, key="session_panel"):
        left, right = st.columns([1.5, 1], gap="medium")
        with left:
            st.markdown(f"**Session:** {sv.md_escape(session.name)}")
            st.caption(sv.md_escape(sv.session_caption(session)))
            if session.notes.strip():
                st.markdown(sv.md_escape(session.notes))
            origin = st.session_state.get("run_origin") or {}
            if origin.get("stored"):
                st.caption("The layer views show the session's stored probes (no model run). Replay re-runs them.")
        with right:
            st.code(sv.share_link(app_url(), session.id), language=None, wrap_lines=True)
        with st.container(horizontal=True, key="session_actions"):
            replay_clicked = st.button("Replay", key="replay_btn", type="primary", help="Re-run the stored prompt on "
                                       "the loaded model and check that selections, mixing and routing come out "
                                       "identical.")
            st.button("Duplicate", key="dup_btn", on_click=on_duplicate, args=(session.id,))
            st.download_button("Export JSON", session_export(session), sv.export_filename(session.name, session.id),
                               "application/json", key="export_btn", on_click="ignore")
            with st.popover("Rename / notes"):
                st.text_input("Name", value=session.name, key="edit_name")
                st.text_area("Notes", value=session.notes, key="edit_notes", height=120)
                st.button("Save changes", key="edit_save", on_click=on_edit, args=(session.id, session.revision))
            if st.button("Delete…", key="delete_btn"):
                st.session_state["_confirm_delete"] = session.id
            st.button("Close", key="close_btn", on_click=close_session)
        if replay_clicked:
            replay(session, source, path)
        if st.session_state.get("_confirm_delete") == session.id:
            st.warning(sv.md_escape(f"Delete the session “{session.name}” for everyone? Its link stops working."))
            a, b, _ = st.columns([1, 1, 4])
            a.button("Yes, delete", key="delete_yes", type="primary", on_click=on_delete, args=(session.id,))
            b.button("Cancel", key="delete_no", on_click=lambda: st.session_state.pop("_confirm_delete", None))
        shown = st.session_state.get("replay")
        if shown and shown[0] == session.id:
            _, result, note = shown
            if note:
                st.warning(sv.md_escape(note))
            (st.success if result.identical else st.warning)(result.headline)
            if result.lines:
                st.code("\n".join(result.lines), language=None)


def session_export(session) -> str:
    store, _ = cached_store()
    try:
        return store.export_json(session.id)
    except SessionError:
        return sv.export_document(session.data())


def app_url() -> str:
    try:
        return (st.context.url or "").split("?")[0]
    except Exception:   # no browser context (AppTest)
        return ""


def sessions_sidebar() -> None:
    """Save, search, open and import team sessions (sidebar, under the prompt)."""
    st.sidebar.markdown("### Sessions")
    store, why = cached_store()
    if store is None:
        st.sidebar.error(sv.md_escape(f"Team sessions are unavailable: {why}"))
        st.sidebar.download_button("Export this analysis (JSON)", current_export(), "analysis.json",
                                   "application/json", key="export_current", on_click="ignore")
        st.sidebar.button("Retry the database", key="store_retry", on_click=open_store.clear)
        return
    st.sidebar.caption(sv.md_escape(f"Shared with the team in {store.describe()}."))
    with st.sidebar.expander("Save this analysis"):
        with st.form("save_form", border=False):
            st.text_input("Name", key="save_name", max_chars=200, placeholder="Copy heads at layer 24")
            st.text_input("Author", key="save_author", max_chars=100)
            st.text_area("Notes", key="save_notes", height=90)
            st.form_submit_button("Save session", type="primary", on_click=on_save)
    with st.sidebar.expander("Open a team session", expanded=bool(st.session_state.get("session_query"))):
        query = st.text_input("Search", key="session_query", placeholder="name, author, prompt text, layer:24")
        try:
            found = store.list_sessions(query, limit=50)
        except SessionError as err:
            st.error(sv.md_escape(str(err)))
            found = []
        if found:
            labels = {s.id: sv.summary_label(s) for s in found}
            pick = st.selectbox("Session", list(labels), format_func=labels.get, key="session_pick")
            st.button("Open", key="session_open", on_click=open_session, args=(pick,))
        else:
            st.caption("No session matches." if query.strip() else "No sessions saved yet.")
        st.file_uploader("Import a session file", type=["json"], key="session_import", on_change=on_import)


def current_export() -> str:
    try:
        return sv.export_document(current_data("Unsaved analysis", "unknown", ""))
    except Exception as err:
        return json.dumps({"error": f"cannot export: {err}"})


def compare_section(cfg, plan, run: dict | None, source: str, path: str) -> None:
    """Two runs at the selected layer: the one on screen (A) and a saved session or another prompt (B)."""
    r = plan[view().layer]
    st.markdown(f"### Side by side at layer {r.layer}",
                help="Which KV entries each query selected and which experts each token was routed to, in run A "
                     "(on screen) and run B; blue only in A, orange only in B, grey in both.")
    if run is None:
        st.caption("Needs a run on screen (A): load model weights, or open a session.")
        return
    mode = st.radio("Compare with", ["session", "prompt"], key="cmp_mode", horizontal=True,
                    format_func={"session": "a saved session", "prompt": "another prompt"}.get)
    run_b, label_b = None, "B"
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
        pick = st.selectbox("Session B", list(choices), format_func=choices.get, key="cmp_session")
        try:
            other = store.load(pick)
        except SessionError as err:
            st.warning(sv.md_escape(str(err)))
            return
        run_b, label_b = other.probes, other.name
    else:
        text_b = st.text_area("Prompt B", key="cmp_prompt", height=90)
        folder = weights_folder(source, path)
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
    for line in sv.comparison_summary(cmp):
        st.markdown(f"- {sv.md_escape(line)}")
    a, b = st.columns(2)
    if cmp.has_selections:
        with a:
            chart(sv.comparison_figure(cmp, "selections"), "cmp_selections", png="comparison_selections")
    if cmp.has_routing:
        with b:
            chart(sv.comparison_figure(cmp, "routing"), "cmp_routing", png="comparison_routing")
    rows = sv.comparison_rows(cmp, only_differences=True)
    if rows:
        st.dataframe(rows, hide_index=True, height=min(320, 38 + 35 * len(rows)))
    else:
        st.caption("No position differs.")


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
        guarded("Cannot draw the tally", tally_column, tally)

    run_started = time.perf_counter()
    run, why = live_run(source, path, text, span, plan)
    log_time("live_run", run_started)
    st.session_state["_analysis"] = dict(view=view(), role=plan[view().layer], source=source, path=path, text=text,
                                         span=span, run=run, origin=st.session_state.get("run_origin"))
    with panel:
        guarded("Cannot show the session", session_panel, source, path)
    st.divider()
    guarded("Cannot draw the layer views", live_views, cfg, plan, run, why)
    guarded("Cannot run the kernel parity check", kernel_parity_panel, source, path, text, plan)
    st.divider()
    guarded("Cannot draw the comparison", compare_section, cfg, plan, run, source, path)
    scroll_if_asked()
    st.query_params.from_dict({**{k: v for k, v in st.query_params.to_dict().items()
                                  if k not in ("layer", "tab", "pos", "session")}, **view().to_query()})
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
    except (ConfigError, OSError, ValueError) as err:
        fail("Cannot read the model", err)
        st.stop()

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
    st.markdown(f"<span class='muted'>{cfg.n_layers} layers + {cfg.n_mtp_layers} DSpark stages · "
                f"{fmt_params(tally.total_params)} parameters · {fmt_params(tally.active_decode_params)} active per "
                f"generated token · {kv_view.kv_bytes_per_token(cfg):g} B of global KV per token · "
                f"{'config' if tally.source == 'config' else 'checkpoint headers'}</span>", unsafe_allow_html=True)
    analysis(cfg, plan, tally, source, path, text, span)
    st.divider()
    guarded("Cannot draw the KV panel", kv_panel, cfg, st.session_state.get("_analysis", {}).get("run"))
    guarded("Cannot show the sessions", sessions_sidebar)
    log_time("script", started)


main()
