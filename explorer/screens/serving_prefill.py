"""A decoder layer's serving note and the "serving prefill" switch: the generated tokens' views of the
layer under the reference's full prefill and a CED prefill (engine/run/ced.py), side by side
(explorer/ced_view.py holds the comparison and the figures)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from engine.roles import decoder_start
from explorer import ced_view
from explorer.screens.common import cached_engine, chart, cpu_refusal, fail

MAX_STEPS = 32


@st.cache_resource(show_spinner="Prefilling the prompt both ways and generating…", max_entries=8)
def _runs(identity: str, folder: str, text: str, layer: int, replay: int, steps: int, spans: tuple):
    """(full run JSON, CED run JSON teacher-forced on the full run's tokens) for one layer."""
    engine = cached_engine(folder)
    kw = dict(layers=[layer], probes=("topk", "routing"), image_spans=list(spans), generated_probes=True)
    full = engine.run(text, generate=steps, **kw)
    ced = engine.run(text, prefill="ced", replay=replay, continuation=full.generated_ids, **kw)
    return full.to_json(), ced.to_json()


def serving_prefill_section(cfg, role) -> None:
    """The note on a decoder layer's live view, and the switch comparing the two prefills there (the
    prompt and model as the page's analysis holds them: st.session_state["_analysis"])."""
    analysis = st.session_state.get("_analysis") or {}
    source, path, text, span = (analysis.get(k) for k in ("source", "path", "text", "span"))
    origin = analysis.get("origin") or {}
    runnable = analysis.get("run") is not None and origin.get("stored") is False  # a live run of this model
    split = decoder_start(cfg)
    note = None if role.is_dspark else ced_view.decoder_note(role.layer, split, cfg.window_size)
    if note is None:
        return
    st.caption(note)
    if not st.toggle("Serving prefill: the generated tokens under a CED prefill and the full one", key="ced_switch"):
        return
    if not runnable:
        st.caption("Needs a live run of this prompt by a model loaded here (not a stored or saved run).")
        return
    refusal = cpu_refusal(source, path)
    if refusal:
        st.caption(refusal)
        return
    left, right = st.columns(2)
    replay = int(left.number_input("Replay R (prompt tokens the decoder runs on)", min_value=1,
                                   value=cfg.window_size, step=cfg.window_size, key="ced_replay"))
    steps = int(right.slider("Generated tokens", 2, MAX_STEPS, 16, key="ced_steps"))
    engine = cached_engine(str(Path(path)))
    try:
        full, ced = _runs(engine.identity, str(Path(path)), text, role.layer, replay, steps, (span,) if span else ())
    except Exception as err:   # the engine's messages are written for users
        if "unknown fields" in str(err):   # an engine service from before it passed prefill/continuation
            st.caption("The engine service this app is attached to predates the CED prefill (it refused the "
                       "request's fields); restart it from this version, or load the model here.")
        else:
            fail("The serving-prefill runs failed", err)
        return
    try:
        cmp = ced_view.compare(full, ced, role.layer, token_text=getattr(engine, "token_strings", None))
    except ced_view.ComparisonError as err:
        fail("Cannot compare the two prefills", err)
        return
    s = cmp.summary()
    cols = st.columns(5)
    cols[0].metric("Full prefill", f"{s['full_prefill_s']:.2f} s")
    cols[1].metric(f"CED prefill (R={cmp.replay})", f"{s['ced_prefill_s']:.2f} s",
                   f"{s['time_ratio']:.2f}x of full" if s["time_ratio"] else None, delta_color="off")
    cols[2].metric("Top-k Jaccard", "-" if s["topk_jaccard"] is None else f"{s['topk_jaccard']:.3f}")
    cols[3].metric("Routing agreement", f"{s['routing_agreement']:.3f}")
    cols[4].metric("Greedy continuations part at",
                   "never" if cmp.diverges_at >= len(cmp.full_picks) else f"token {cmp.diverges_at}")
    chart(ced_view.side_by_side_figure(cmp), "ced_side", tag=f"layer {role.layer} R {cmp.replay}",
          png=f"layer{role.layer}-ced-vs-full-R{cmp.replay}.png")
    st.caption("Both runs are fed the same generated tokens (the full run's greedy continuation); grey marks "
               "what both prefills picked, coloured what only that side picked. Times are the prefill alone.")
    chart(ced_view.agreement_figure(cmp), "ced_agreement", tag=f"layer {role.layer} R {cmp.replay}")
    st.caption(f"Full prefill continues: {full.get('generated_text', '')!r}")
