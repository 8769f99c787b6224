"""Reading the selections on screen: one query position shared by every live view (slider, a click on
a token or on a row of the top-k map), the scores behind a query's picks with ties marked, the
selection recall on request, the gate scores behind a token's experts, export names and the glossary."""

from __future__ import annotations

import traceback

import streamlit as st

from explorer import chart_titles as ct, glossary as gl, prompt as pr, selection_view as sel
from explorer.screens.common import cached_engine, named_chart
from explorer.token_strip import strip_html, token_strip

QUERY_KEY = "query_pos"
DETAIL_KEYS = ("runner_ups", "runner_up_scores", "selection_recall")


# -- the shared query -------------------------------------------------------------------------

def set_query(q: int) -> None:
    st.session_state[QUERY_KEY] = int(q)


def query_slider(n_tokens: int) -> int:
    """The one query position of every live view (also set by clicks on tokens and map rows)."""
    last = n_tokens - 1
    if not 0 <= st.session_state.get(QUERY_KEY, last) <= last:   # a shorter prompt than before
        st.session_state[QUERY_KEY] = last
    if last == 0:
        st.session_state[QUERY_KEY] = 0
        st.caption("Query token: 0 (a one-token prompt).")
        return 0
    return st.slider("Query token", 0, last, last, key=QUERY_KEY,
                     help="The token whose selections, mHC weights and experts the views below show. Click a token "
                          "in the strip or a row of the top-k map to pick it there.")


def on_map_click(points: list) -> None:
    """A click on the top-k map: its row (the query position, a bin's first one) becomes the query."""
    for p in points or []:
        y = p.get("y") if isinstance(p, dict) else None
        if isinstance(y, (int, float)) and not isinstance(y, bool):
            set_query(int(y))
            return


def strip(tokens, counts, q, highlight, image, layer: int) -> None:
    token_strip(strip_html(tokens, counts, query=q, highlight=highlight, image=image), key="token_strip",
                tag=f"layer {layer}", on_pick=set_query)


# -- names ------------------------------------------------------------------------------------

def model_name() -> str:
    a = st.session_state.get("_analysis") or {}
    return ct.model_label(a.get("source"), a.get("path"))


def names(what: str, layer: int | None = None, query: int | None = None) -> tuple[str, str]:
    """(file name without extension, chart title) naming model, layer, query and the prompt's hash."""
    name = chart_name(what, layer, query)
    return name.file, name.title


def chart_name(what: str, layer: int | None = None, query: int | None = None) -> ct.ChartName:
    """A live view's export name: the model and prompt of the run on screen."""
    text = (st.session_state.get("_analysis") or {}).get("text")
    return ct.ChartName(what, model_name(), layer, query, prompt=text or None)


def titled_chart(fig, key: str, what: str, layer: int, query: int | None = None, **kw) -> None:
    """A chart whose PNG export carries its title and a file name that says what it shows."""
    named_chart(fig, key, chart_name(what, layer, query), **kw)


# -- scores behind the picks --------------------------------------------------------------------

@st.cache_resource(show_spinner="Scoring every visible entry of this layer…", max_entries=8)
def detail_run(identity: str, folder: str, text: str, layers: tuple, spans: tuple) -> dict:
    """The prompt run again with the runner-ups and the selection recall of these layers."""
    got = cached_engine(folder).run(text, layers=list(layers), detail_layers=list(layers), image_spans=list(spans))
    return got.to_json(layers=list(layers))


def _detail_key(r) -> tuple | None:
    a = st.session_state.get("_analysis") or {}
    origin = a.get("origin") or {}
    if origin.get("stored") or not origin.get("identity") or a.get("source") == pr.SOURCE_CONFIG:
        return None
    layers = tuple(sorted({r.layer} | ({r.index_source} if r.index_source is not None else set())))
    span = a.get("span")
    return (origin["identity"], str(a.get("path")), a.get("text") or "", layers, (span,) if span else ())


def with_detail(probe: dict, detail: dict | None) -> dict:
    if not detail:
        return probe
    return {**probe, **{k: detail[k] for k in DETAIL_KEYS if k in detail}}


def scores_section(r, run: dict, probe: dict, source_probe: dict, tokens: list[str], q: int) -> None:
    """The query's picks against the best unpicked entries, ties marked; zero-score picks and (on
    request) selection recall across the prompt."""
    key = _detail_key(r)
    detail = None
    asked = st.session_state.setdefault("_detail_asked", set())
    if key is not None and key in asked:
        try:
            detail = detail_run(*key)
        except Exception as err:   # the engine's messages are written for users
            print(traceback.format_exc())
            st.warning(f"Could not score the unpicked entries: {err}")
    src = with_detail(source_probe, lv_probe(detail, r.index_source))
    own = with_detail(probe, lv_probe(detail, r.layer))
    shown = {**src, "selection_recall": own.get("selection_recall")}
    qs = sel.query_scores(src, q)
    summary = sel.selection_summary(shown)
    titled_chart(sel.selection_figure(qs, shown, int(source_probe.get("compress_ratio") or 1), tokens),
                 "topk_scores", "index scores of the picks", r.layer, q, tag=f"layer {r.layer}")
    st.caption(sel.scores_caption(qs, r.layer, r.index_source, run.get("numerics")) + " "
               + gl.CAPTIONS["prompt_scores"])
    line = (f"Over the prompt: {summary['zero_picks']:,} of {summary['picks']:,} picks "
            f"({100 * summary['zero_share']:.1f}%) scored exactly 0")
    if summary["mean_recall"] is not None:
        line += f"; mean selection recall {summary['mean_recall']:.3f} (1 = the picks hold all the attention mass)"
    st.markdown(line + ".")
    if detail is None and key is not None:
        st.button("Score the unpicked entries (runner-ups and selection recall)", key="detail_btn",
                  on_click=lambda: asked.add(key),
                  help="Runs the prompt again with this layer scoring every visible entry: the best unpicked "
                       "entries and the share of full attention mass the picks capture.")
    elif key is None:
        st.caption("Runner-ups and selection recall need the model (not a stored session or the config only).")


def lv_probe(run: dict | None, layer: int | None) -> dict | None:
    if not run or layer is None:
        return None
    layers = run.get("layers") or {}
    return layers.get(str(layer))


# -- gate scores behind the experts -------------------------------------------------------------

def routing_margin_section(r, probe: dict, q: int, n_active: int) -> None:
    if not (probe.get("routing") or {}).get("scores"):
        return
    m = sel.routing_margin(probe, q)
    titled_chart(sel.routing_figure(probe, q), "routing_margin", "gate scores of the chosen experts", r.layer, q,
                 tag=f"layer {r.layer}")
    st.caption(sel.routing_caption(m, n_active))


def glossary_expander() -> None:
    """The glossary, built only when opened (a closed expander's text was re-sent on every click)."""
    box = st.expander("Glossary: the words on this page", key="glossary_box", on_change="rerun")
    if box.open:
        box.markdown(gl.glossary_markdown())
