"""The "Serving plan" screen: Streamlit widgets over explorer.planner_view and engine.plan.

One call from app.py draws it in its own expander. The expander runs its content only when open (its
state is in the URL as `plan_open`), and the content is a fragment: changing an input redraws only
this screen. The inputs live in the URL (`plan_gpu`, `plan_gpus`, ...) and come back from a saved
session's view dict ({"plan": {...}}) when one is opened.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from engine.config import ModelConfig, release_config
from engine.plan import ENGRAM_PLACES, GPUS, MAX_BATCH, MAX_GPUS, PlanError, PlanInputs, make_plan, model_max_context
from engine.tally import Tally, tally_from_config

from .. import planner_view as pv
from .common import chart

ENGRAM_TITLES = {"gpu": "on the GPUs", "host": "in host memory", "disk": "on disk"}
MODEL_KEY = "plan_model"


@st.cache_resource(show_spinner=False)
def release_model() -> tuple[ModelConfig, Tally]:
    cfg = release_config()
    return cfg, tally_from_config(cfg)


@st.cache_resource(show_spinner=False)
def bench_comparisons() -> list[dict]:
    cfg, _ = release_model()
    return [pv.measured_vs_predicted(cfg, run) for run in pv.bench_runs()]


def session_settings() -> dict[str, Any]:
    """The plan inputs on screen, for a saved session's view dict (see planner_view.session_settings):
    the widgets' values, or the URL's while the expander is closed (its widgets are then gone from
    the session state); {} when neither has any."""
    state = st.session_state
    if all(key in state for key in pv.URL_KEYS):
        return {"plan": {name: state[key] for key, name in pv.URL_KEYS.items()}}
    query = st.query_params.to_dict()
    if not any(key in query for key in pv.URL_KEYS):
        return {}
    inputs, _ = pv.inputs_from_mapping(query, release_model()[0], pv.URL_KEYS)
    return pv.session_settings(inputs)


def _write(inputs: PlanInputs) -> None:
    for key, name in pv.URL_KEYS.items():
        st.session_state[key] = getattr(inputs, name)


def _seed(cfg: ModelConfig) -> list[str]:
    """The URL's inputs on the first draw, an opened session's when it changes; messages for bad values."""
    state, problems = st.session_state, []
    if "plan_gpu" not in state:
        inputs, problems = pv.inputs_from_mapping(st.query_params.to_dict(), cfg, pv.URL_KEYS)
        _write(inputs)
    session = state.get("open_session")
    if session is not None and state.get("_plan_session") != session.id:
        state["_plan_session"] = session.id
        got = pv.inputs_from_session(getattr(session, "view", None), cfg)
        if got is not None:
            _write(got[0])
            problems += got[1]
    return problems


def _nearest(value: int, choices: list[int]) -> int:
    below = [c for c in choices if c <= value]
    return max(below) if below else choices[0]


def render_serving_plan(cfg: ModelConfig, run: dict | None = None) -> None:
    """The whole screen in its expander. `cfg` is the model the app shows (its live run's caches are
    compared with the plan); the plan itself is for the release unless asked for the loaded model."""
    box = st.expander("Serving plan: what it takes to serve V4.1-Flash", key="plan_open",
                      bind="query-params", icon=":material/dns:")
    if not box.open:
        return
    with box:
        _body(cfg, run)


@st.fragment
def _body(loaded: ModelConfig, run: dict | None) -> None:
    release, release_tally = release_model()
    cfg, tally = release, release_tally
    if loaded != release:
        pick = st.radio("Plan for", ["release", "loaded"], key=MODEL_KEY, horizontal=True,
                        format_func={"release": "the release (V4.1-Flash)", "loaded": "the loaded model's config"}.get)
        if pick == "loaded":
            cfg, tally = loaded, tally_from_config(loaded)
    for problem in _seed(cfg):
        st.warning(problem)
    state = st.session_state
    top = model_max_context(cfg)
    c = st.columns([1.5, 0.8, 0.8, 0.8, 1.0, 1.0, 1.2, 1.3], vertical_alignment="bottom")
    c[0].selectbox("GPU", list(GPUS), key="plan_gpu", format_func=lambda k: GPUS[k].name)
    gpus = int(c[1].number_input("GPUs", min_value=1, max_value=MAX_GPUS, step=1, key="plan_gpus"))
    tps, eps = pv.tp_choices(cfg, gpus), pv.ep_choices(cfg, gpus)
    state["plan_tp"] = state["plan_tp"] if state.get("plan_tp") in tps else _nearest(int(state.get("plan_tp") or 1), tps)
    state["plan_ep"] = state["plan_ep"] if state.get("plan_ep") in eps else _nearest(int(state.get("plan_ep") or 1), eps)
    c[2].selectbox("TP", tps, key="plan_tp", help="Tensor parallel: attention heads, indexer heads, vocabulary.")
    c[3].selectbox("EP", eps, key="plan_ep", help="Expert parallel: the routed experts in contiguous ranges.")
    c[4].checkbox("DP attention", key="plan_dp", help="Each attention group serves its own sequences "
                  "(without it every group computes every sequence, as the engine's replicated parts do).")
    state["plan_ctx"] = min(int(state.get("plan_ctx") or 1), top)
    c[5].number_input("Batch", min_value=1, max_value=MAX_BATCH, step=1, key="plan_batch")
    c[6].number_input("Context (tokens)", min_value=1, max_value=top, step=1024, key="plan_ctx",
                      help=f"Any length up to the model's maximum, {top:,}.")
    c[7].selectbox("Engram tables", list(ENGRAM_PLACES), key="plan_engram", format_func=ENGRAM_TITLES.get)
    inputs = PlanInputs(gpu=state["plan_gpu"], gpus=gpus, ep=int(state["plan_ep"]), tp=int(state["plan_tp"]),
                        dp_attention=bool(state["plan_dp"]), batch=int(state["plan_batch"]),
                        context=int(state["plan_ctx"]), engram=state["plan_engram"])
    st.query_params.update(pv.inputs_to_query(inputs))
    try:
        plan = make_plan(cfg, inputs, tally)
    except PlanError as err:
        st.error(f"This layout cannot be planned: {err}")
        return
    for col, (label, value, why) in zip(st.columns(5), pv.headline(plan)):
        col.metric(label, value, help=why)
    chart(pv.memory_figure(plan), "plan_memory_chart", tag=f"{inputs.gpu} {inputs.batch} {inputs.context}",
          png=f"serving_plan_{inputs.gpu}x{inputs.gpus}_bytes_per_gpu")
    for note in plan.notes:
        st.caption(note)
    left, right = st.columns([1.7, 1], gap="medium")
    with left:
        decode, prefill = st.tabs([f"Decode step: {plan.decode.time_s * 1e3:.2f} ms ({plan.decode.limit})",
                                   f"Prefill chunk: {plan.prefill.time_s * 1e3:.1f} ms ({plan.prefill.limit})"])
        for tab, ph, what in ((decode, plan.decode, f"{plan.decode.tokens:,} sequence(s) decoding one token each at "
                                                    f"{inputs.context:,} tokens"),
                              (prefill, plan.prefill, f"one chunk of {plan.prefill.tokens:,} tokens ending at "
                                                      f"{inputs.context:,}")):
            with tab:
                st.dataframe(pv.roofline_rows(ph), hide_index=True, width="stretch")
                sent = ", ".join(f"{k} {pv.fmt_bytes(v)}" for k, v in ph.comm.items()) or "nothing (one GPU)"
                fetch = f" Engram rows from {inputs.engram}: {ph.fetch_s * 1e3:.2f} ms, prefetched." if ph.fetch_s else ""
                st.caption(f"Per GPU, {what}. Sent per GPU: {sent}.{fetch} Times are roofline lower bounds at "
                           f"{plan.gpu.name} datasheet rates.")
    with right:
        series = pv.batch_series(cfg, tally, inputs)
        chart(pv.batch_figure(series, inputs), "plan_batch_chart", tag=f"{inputs.gpus} {inputs.tp} {inputs.ep}",
              png="serving_plan_largest_batch")
        st.caption("Largest batch that fits against context length, each GPU model in this layout.")
    _measured(loaded, run, cfg is release)


def _measured(loaded: ModelConfig, run: dict | None, planning_release: bool) -> None:
    """Measured figures beside the prediction: the live run's caches, the stored bench runs."""
    st.markdown("**Measured beside predicted**")
    live = pv.live_cache(loaded, run)
    if live:
        verdict = "equal" if live["match"] else "NOT equal"
        st.caption(f"The live run ({live['tokens']:,} tokens, batch 1, the loaded model): the engine's cache bytes "
                   f"and the plan's are {verdict}.")
        st.dataframe(live["rows"], hide_index=True)
    else:
        st.caption("No live run yet: the loaded model's measured cache bytes appear here after a run.")
    runs = bench_comparisons() if planning_release else []
    if not runs:
        st.caption("No release-size layer time measured yet in benches/results (benches/parallel.py writes them).")
        return
    for m in runs:
        held = "-" if m["measured_weights"] is None else f"{m['measured_weights']:,} B"
        st.caption(f"{m['file']}: {m['world']} × {m['device']}, the first {m['n_layers']} release-size layers, one "
                   f"{m['tokens']:,}-token prompt (TP = EP = {m['world']}). Weights per GPU: plan "
                   f"{m['predicted_weights']:,} B, held {held}. Layer times: bound "
                   f"{m['predicted_total_ms']:,.1f} ms, measured {m['measured_total_ms']:,.0f} ms (the engine "
                   "computes in fp32 from dequantized weights).")
        st.dataframe(m["rows"], hide_index=True, height=min(300, 38 + 35 * len(m["rows"])))

