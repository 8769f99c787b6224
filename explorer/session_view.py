"""The sessions UI's view models: a session from the current view and run, a view from a session,
listings, share links, replay messages and the side-by-side comparison of two runs at one layer.

Plain Python and Plotly only (no Streamlit), so every piece is testable on its own. User text (names,
notes, prompts) is returned as plain text: the app shows it with widgets that escape it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlencode

import numpy as np


from engine.roles import TABS, LayerRole

from .figure import Figure
from .kv_view import CONTEXT_CHOICES
from .session_compare import LayerComparison, ReplayReport
from .sessions import Session, SessionData, SessionSummary, new_session_id, session_to_export
from .state import POSITIONS, ViewState
from .style import GRID, MUTED, base_layout

# widget keys whose values are part of a session's "view settings" (besides layer, tab, position)
SETTING_KEYS = ("query_pos", "mhc_pos", "context_len")
SPAN_LABEL = "image"
COLOUR_A, COLOUR_B, COLOUR_BOTH = "#0072B2", "#D55E00", "#B8BEC8"


# -- saving ---------------------------------------------------------------------------------------

def looked_at_layers(role: LayerRole) -> list[int]:
    """The layers a user looks at on one layer's page: the layer and the layer whose top-k it shows."""
    return sorted({role.layer} | ({role.index_source} if role.index_source is not None else set()))


def trim_run(run: Mapping[str, Any] | None, layers: Iterable[int]) -> dict[str, Any] | None:
    """The run with only `layers` kept in its probes (keeps a shared session small)."""
    if not run:
        return None
    keep = {str(int(layer)) for layer in layers}
    out = dict(run)
    out["layers"] = {k: v for k, v in (run.get("layers") or {}).items() if str(k) in keep}
    return out


def span_marks(span: tuple[int, int] | None) -> list[dict[str, Any]]:
    """The sidebar's image span as the session's token-span marks."""
    if not span:
        return []
    return [{"prompt": 0, "start": int(span[0]), "end": int(span[1]), "label": SPAN_LABEL}]


def image_span(marks: Iterable[Mapping[str, Any]]) -> tuple[int, int] | None:
    """The first image mark of prompt 0 as (start, end), or None."""
    for mark in marks or []:
        try:
            if int(mark.get("prompt", 0)) == 0 and mark.get("label", SPAN_LABEL) == SPAN_LABEL:
                start, end = int(mark["start"]), int(mark["end"])
                if 0 <= start < end:
                    return start, end
        except (KeyError, TypeError, ValueError):
            continue
    return None


def build_session_data(*, name: str, author: str, notes: str, view: ViewState, role: LayerRole,
                       source_kind: str, model_source: str, model_identity: str, engine_version: str,
                       prompt: str, span: tuple[int, int] | None, settings: Mapping[str, Any] | None = None,
                       run: Mapping[str, Any] | None = None, prompt_b: str | None = None,
                       plan_settings: Mapping[str, Any] | None = None) -> SessionData:
    """What "Save" stores: model, prompt and marks, the view (layer, tab, position, widget settings,
    the serving plan's inputs as {"plan": {...}}) and the run's probes of the layers looked at;
    `prompt_b`, the side by side's other prompt, as the second prompt (its run is not stored: opening
    the session offers it to run again). Validation is the store's job."""
    view_settings: dict[str, Any] = {"position": view.position, "source": source_kind}
    if plan_settings and isinstance(plan_settings.get("plan"), Mapping):
        view_settings["plan"] = dict(plan_settings["plan"])
    for key in SETTING_KEYS:
        value = (settings or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            view_settings[key] = int(value)
    return SessionData(
        name=name.strip(), author=author.strip(), notes=notes,
        model_source=model_source, model_identity=model_identity or "",
        engine_version=engine_version or str((run or {}).get("engine_version") or ""),
        prompts=[prompt] + ([prompt_b] if prompt_b and prompt_b.strip() else []), spans=span_marks(span), layer=view.layer, tab=view.tab, view=view_settings,
        probes=trim_run(run, looked_at_layers(role)),
    )


def export_document(data: SessionData) -> str:
    """An export file for an analysis that is not stored (e.g. the database is down); it imports
    like any exported session."""
    now = datetime.now(timezone.utc)
    session = Session(**{k: getattr(data, k) for k in SessionData.__dataclass_fields__},
                      id=new_session_id(), created_at=now, updated_at=now, revision=0)
    return json.dumps(session_to_export(session), ensure_ascii=False, indent=1)


def export_filename(name: str, session_id: str | None = None) -> str:
    """A safe file name for a session export."""
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in name.strip())[:60].strip("_") or "session"
    return f"{stem}-{session_id[:8]}.json" if session_id else f"{stem}.json"


# -- opening --------------------------------------------------------------------------------------

def view_from_session(session: SessionData, plan: list[LayerRole],
                      session_id: str | None = None) -> tuple[ViewState, list[str]]:
    """The view a session restores, with a message for everything that does not fit this model."""
    problems = []
    layer = session.layer if session.layer is not None else None
    if layer is None or not 0 <= layer < len(plan):
        fallback = 24 if len(plan) > 24 else 0
        if layer is not None:
            problems.append(f"The session's layer {layer} is not a layer of this model (0..{len(plan) - 1}); "
                            f"showing layer {fallback}.")
        layer = fallback
    tab = session.tab if session.tab in TABS else plan[layer].tab
    position = (session.view or {}).get("position")
    position = position if position in POSITIONS else "total"
    return ViewState(layer=layer, tab=tab, position=position, session=session_id), problems


def widget_state(session: SessionData) -> dict[str, Any]:
    """Sidebar and view widget values (st.session_state keys) that reproduce the session."""
    out: dict[str, Any] = {"prompt_text": session.prompts[0] if session.prompts else ""}
    if len(session.prompts) > 1:      # the side by side was against another prompt: set it up again
        out.update(cmp_mode="prompt", cmp_prompt=session.prompts[1])
    span = image_span(session.spans)
    out["image_on"] = span is not None
    out["image_span"] = f"{span[0]}-{span[1]}" if span else ""
    n_tokens = len((session.probes or {}).get("tokens") or [])
    for key in SETTING_KEYS:
        value = (session.view or {}).get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        # a slider value must lie within its range: token positions within the stored run,
        # the context length among the KV panel's choices
        if key == "context_len" and value not in CONTEXT_CHOICES:
            continue
        if key != "context_len" and not 0 <= value < n_tokens:
            continue
        out[key] = value
    return out


def stored_run(session: SessionData | None, role: LayerRole, prompt: str,
               span: tuple[int, int] | None) -> dict[str, Any] | None:
    """The session's probes when they cover this layer's page for the same prompt and marks, else None
    (then the app runs the model as usual)."""
    if session is None or not session.probes or not session.prompts:
        return None
    if session.prompts[0] != prompt or image_span(session.spans) != span:
        return None
    layers = session.probes.get("layers") or {}
    if not all(str(layer) in layers for layer in looked_at_layers(role)):
        return None
    return dict(session.probes)


def probed_layers(probes: Mapping[str, Any] | None) -> list[int]:
    return sorted(int(k) for k in (probes or {}).get("layers", {}) if str(k).lstrip("-").isdigit())


def share_link(base_url: str, session_id: str) -> str:
    """`<app url>/?session=ID` (the session restores its own layer, tab and views)."""
    return f"{base_url.rstrip('/')}/?{urlencode({'session': session_id})}"


# -- listings -------------------------------------------------------------------------------------

def short_text(text: str, limit: int = 60) -> str:
    """One line, at most `limit` characters."""
    line = " ".join((text or "").split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def when(moment: datetime, now: datetime | None = None) -> str:
    """`just now`, `5 min ago`, `3 h ago`, else the UTC date."""
    now = now or datetime.now(timezone.utc)
    seconds = (now - moment).total_seconds()
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d")


def summary_label(s: SessionSummary, now: datetime | None = None) -> str:
    """One selectbox line: name · author · layer · when."""
    layer = f"layer {s.layer}" if s.layer is not None else "no layer"
    return f"{short_text(s.name, 48)} · {short_text(s.author, 24)} · {layer} · {when(s.updated_at, now)}"


def summary_rows(summaries: Iterable[SessionSummary], now: datetime | None = None) -> list[dict[str, Any]]:
    """Rows for a listing table (plain text; a dataframe escapes it)."""
    return [{"Name": s.name, "Author": s.author, "Layer": s.layer,
             "Prompt": short_text(s.prompts[0] if s.prompts else "", 50),
             "Changed": when(s.updated_at, now)} for s in summaries]


def session_caption(session: Session, now: datetime | None = None) -> str:
    """`by ana · layer 24 · saved 5 min ago · revision 2 · 2 probed layers` (plain text)."""
    parts = [f"by {session.author}"]
    if session.layer is not None:
        parts.append(f"layer {session.layer}")
    parts.append(f"changed {when(session.updated_at, now)}")
    if session.revision > 1:
        parts.append(f"revision {session.revision}")
    layers = probed_layers(session.probes)
    parts.append(f"probes of layer{'s' if len(layers) != 1 else ''} {', '.join(map(str, layers))}" if layers
                 else "no probes stored")
    return " · ".join(parts)


# -- replay ---------------------------------------------------------------------------------------

def identity_note(session: SessionData, loaded_identity: str) -> str | None:
    """A warning when the session was saved with another model than the one loaded now."""
    if not session.model_identity:
        return "The session does not record which model made it; differences may come from the model."
    if session.model_identity != loaded_identity:
        return (f"The session was saved with model {session.model_identity} ({session.model_source or 'unknown'}); "
                f"the loaded model is {loaded_identity}. Differences may come from the model, not the engine.")
    return None


def replay_layers(session: SessionData) -> list[int]:
    return probed_layers(session.probes) or ([session.layer] if session.layer is not None else [])


@dataclass(frozen=True)
class ReplayView:
    identical: bool
    headline: str
    lines: tuple[str, ...]     # the first differences, one per line (plain text)


def replay_view(report: ReplayReport) -> ReplayView:
    """The replay report as a headline and the first differences per section."""
    if report.identical:
        counts = ", ".join(f"{s.name} {s.compared}" for s in report.sections.values())
        return ReplayView(True, f"Replay identical: selections, mixing (mHC) and routing came out the same "
                                f"(compared: {counts}).", ())
    differing = [s for s in report.sections.values() if not s.identical]
    headline = "Replay differs in " + ", ".join(
        f"{'mixing (mHC)' if s.name == 'mhc' else s.name} ({s.n_differences} of {s.compared})" for s in differing) + "."
    lines = []
    for s in differing:
        lines.extend(f"{s.name}: {d}" for d in s.differences)
    return ReplayView(False, headline, tuple(lines))


# -- side by side ---------------------------------------------------------------------------------

def _fmt(values: Iterable[int]) -> str:
    values = sorted(values)
    return ", ".join(map(str, values)) if values else "—"


def comparison_rows(cmp: LayerComparison, only_differences: bool = False) -> list[dict[str, Any]]:
    """One row per query position: the tokens, what only A / only B selected and routed to."""
    rows = []
    for p in cmp.positions:
        if only_differences and not (p.selections_differ or p.routing_differs):
            continue
        row: dict[str, Any] = {"Pos": p.position, "Token A": p.token_a if p.token_a is not None else "—",
                               "Token B": p.token_b if p.token_b is not None else "—"}
        if cmp.has_selections:
            row.update({"Selected only A": _fmt(p.selected_only_a), "Selected only B": _fmt(p.selected_only_b),
                        "Selected both": len(p.selected_common)})
        if cmp.has_routing:
            row.update({"Experts only A": _fmt(p.experts_only_a), "Experts only B": _fmt(p.experts_only_b),
                        "Experts both": _fmt(p.experts_common)})
        rows.append(row)
    return rows


def comparison_summary(cmp: LayerComparison) -> list[str]:
    """Plain-text lines: how many of the positions both runs have differ, their mean overlap, and the
    positions only one run has (counted apart, so the overlap and the count speak of the same positions)."""
    shared = min(cmp.n_positions_a, cmp.n_positions_b)
    lines = [f"Layer {cmp.layer}: A has {cmp.n_positions_a} tokens, B has {cmp.n_positions_b}."]
    for present, label, diff, overlap in (
            (cmp.has_selections, "Selections differ", cmp.selection_diff_positions, cmp.mean_selection_overlap),
            (cmp.has_routing, "Routing differs", cmp.routing_diff_positions, cmp.mean_expert_overlap)):
        if not present:
            continue
        n_diff = sum(1 for p in diff if p < shared)
        mean = overlap()
        lines.append(f"{label} at {n_diff} of the {shared} positions both runs have"
                     + (f" (mean overlap {mean:.0%})." if mean is not None else "."))
    if cmp.n_positions_a != cmp.n_positions_b:
        longer = "A" if cmp.n_positions_a > cmp.n_positions_b else "B"
        last = max(cmp.n_positions_a, cmp.n_positions_b) - 1
        lines.append(f"Positions {shared}-{last} are only in {longer} (not compared).")
    lines.extend(cmp.notes)
    return lines


def _points(cmp: LayerComparison, kind: str) -> dict[str, tuple[list[int], list[int]]]:
    """(positions, ids) of the ids both runs chose, only A chose, only B chose."""
    out: dict[str, tuple[list[int], list[int]]] = {"both": ([], []), "a": ([], []), "b": ([], [])}
    for p in cmp.positions:
        sets = ((p.selected_common, p.selected_only_a, p.selected_only_b) if kind == "selections"
                else (p.experts_common, p.experts_only_a, p.experts_only_b))
        for name, values in zip(("both", "a", "b"), sets):
            for v in sorted(values):
                out[name][0].append(p.position)
                out[name][1].append(v)
    return out


def comparison_figure(cmp: LayerComparison, kind: str, *, label_a: str = "A", label_b: str = "B",
                      height: int = 320) -> Figure:
    """Query position × chosen id (KV entry for selections, expert for routing): grey where both runs
    chose it, blue only in A, orange only in B. Display only (no clicks)."""
    if kind not in ("selections", "routing"):
        raise ValueError(f"kind must be 'selections' or 'routing', not {kind!r}")
    pts = _points(cmp, kind)
    what = "KV entry" if kind == "selections" else "expert"
    dense = sum(len(xs) for xs, _ in pts.values()) > 3000
    fig = Figure()   # many marks: WebGL (an SVG of ~450k markers froze the browser for 40 s)
    for name, colour, symbol, title in (("both", COLOUR_BOTH, "square", "both"),
                                        ("a", COLOUR_A, "circle", f"only {label_a}"),
                                        ("b", COLOUR_B, "x", f"only {label_b}")):
        xs, ys = pts[name]
        fig.add_trace(dict(
            type="scattergl" if dense else "scatter", x=np.asarray(xs, dtype=np.int32), y=np.asarray(ys, dtype=np.int32),
            mode="markers", name=f"{title} ({len(xs)})",
            marker=dict(color=colour, symbol=symbol, size=(3 if dense else 6) + (name != "both"),
                        line=dict(width=0) if name != "b" else dict(width=1.5, color=colour)),
            hovertemplate=f"position %{{x}} · {what} %{{y}} · {title}<extra></extra>"))
    title = "Top-k selections" if kind == "selections" else "Routed experts"
    fig.update_layout(**base_layout(
        height=height, title=dict(text=f"{title}: {label_a} vs {label_b}", x=0, y=0.98, font=dict(size=13)),
        legend=dict(orientation="h", y=1.0, x=0, yanchor="bottom"), showlegend=True,
        margin=dict(l=50, r=10, t=56, b=40),
        xaxis=dict(title=dict(text="query position"), gridcolor=GRID, zeroline=False),
        yaxis=dict(title=dict(text=what), gridcolor=GRID, zeroline=False, color=MUTED)))
    return fig


def compare_choices(summaries: Iterable[SessionSummary], exclude: str | None) -> dict[str, str]:
    """Second-session choices: id -> label, the open session left out."""
    return {s.id: summary_label(s) for s in summaries if s.id != exclude}


def with_session(view: ViewState, session_id: str | None) -> ViewState:
    return replace(view, session=session_id)


# -- text and model source --------------------------------------------------------------------------

_MD_SPECIAL = set("\\`*_{}[]()#+-.!|<>~$=:")


def md_escape(text: str) -> str:
    """User text made inert for Streamlit markdown (labels, captions): every markdown/HTML character
    backslash-escaped, so it shows literally."""
    return "".join("\\" + c if c in _MD_SPECIAL else c for c in (text or ""))


def notes_markdown(notes: str) -> str:
    """Session notes for st.markdown: escaped, each line break kept (markdown joins single breaks, and
    drops the blank-line ones to one paragraph break)."""
    lines = (notes or "").replace("\r\n", "\n").strip("\n").split("\n")
    return "  \n".join(md_escape(line) if line.strip() else "&#8203;" for line in lines)


def source_state(session: SessionData, folder_exists) -> tuple[dict[str, Any], str | None]:
    """Sidebar model-source values that reopen the session's model, and a note when they cannot.
    `folder_exists(path) -> bool` checks a checkpoint folder on this machine."""
    kind = (session.view or {}).get("source")
    if kind in ("shipped", "config"):
        return {"source": kind}, None
    if kind == "path":
        if session.model_source and folder_exists(session.model_source):
            return {"source": "path", "ckpt_path": session.model_source}, None
        return {}, (f"The session's checkpoint folder {session.model_source or '(none)'} is not on this machine; "
                    "its stored probes are shown with the model chosen in the sidebar.")
    return {}, None


def import_upload(store, filename: str, data: bytes):
    """Store an uploaded export as a new session: (session, None), or (None, a message) when the file
    is not a session export or the store cannot take it. Nothing is stored on failure."""
    from .sessions import InvalidSessionFile, SessionError
    if store is None:
        return None, f"Cannot import {filename}: team sessions are unavailable."
    try:
        return store.import_json(data), None
    except InvalidSessionFile as err:
        return None, f"{filename}: {err} Nothing was imported."
    except SessionError as err:
        return None, f"Cannot import {filename}: {err}"


def damaged_sessions_warning(damaged: Iterable[Any], shown: int = 3) -> str | None:
    """The sidebar's word on stored rows the listing skipped because they cannot be read (the store's
    `list_sessions(...).damaged`), naming them and why; None when there are none."""
    damaged = list(damaged)
    if not damaged:
        return None
    named = "; ".join(f"{getattr(d, 'session_id', '?')!r}: {getattr(d, 'reason', d)}" for d in damaged[:shown])
    more = f"; and {len(damaged) - shown} more" if len(damaged) > shown else ""
    rows = "1 stored session is" if len(damaged) == 1 else f"{len(damaged)} stored sessions are"
    return (f"{rows} damaged and not listed ({named}{more}). They cannot be opened; the others are unaffected. "
            "The server log names them too.")
