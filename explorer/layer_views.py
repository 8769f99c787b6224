"""Live layer views: view models and figures from one run's probes (`RunResult.to_json()`).

The probe layout this module reads (T = prompt tokens, k = index_topk, E = routed experts):
    run = {"tokens": [str]*T, "token_ids": [int]*T, "image_mask": [bool]*T (optional),
           "layers": {"24": layer, ...}, "cache_bytes": int | {"global", "window", "pending", "total"},
           "kv_bytes_formula": number}
    layer = {"role", "kv_source", "index_source", "compress_ratio", "window_size",
             "topk": [[entry]*k]*T (-1 padded) | None, "topk_scores": [[float|None]*k]*T | None,
             "candidate_pool": [[entry, ...]]*T | None,
             "mhc": {"attn"|"ffn": {"pre": [[hc]]*T, "post": [[hc]]*T, "comb": [[[hc]*hc]]*T}},
             "routing": {"experts": [[k]]*T, "weights": [[k]]*T, "scores": [[E]]*T, "image_mask": [bool]*T?},
             "residual_norms": [[hc]]*T | None, "time_s": float}
Global entry j of a layer with compress ratio m covers prompt tokens j*m .. j*m+m-1.
"""

from __future__ import annotations

import csv
import html
import io
import json
from dataclasses import dataclass
from itertools import chain

import numpy as np

from engine.config import ModelConfig
from engine.roles import LayerRole

from .figure import Figure
from .style import BLUES, GRID, INK, MHC_COLOUR, MUTED, PURPLES, ROLE_COLOURS, base_layout

COPY_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000")
MAX_MAP_CELLS = 160          # the top-k map is binned down to at most this many cells per axis (~2-4 px each)


class ProbeError(ValueError):
    """A run's probe data does not have the expected structure; the message says which field."""


# -- headings and notes -------------------------------------------------------------------------

def layer_heading(r: LayerRole) -> str:
    return f"Layer {r.layer} · {r.label}"


def layer_subheading(r: LayerRole, cfg: ModelConfig) -> str:
    """`KV from layer X · top-k from layer Y`, or what the layer does instead."""
    if r.is_dspark:
        return f"DSpark draft stage {r.layer - cfg.n_layers} · window only"
    if r.kv_source is None:
        return f"window only ({cfg.window_size} tokens) · no global branch"
    text = f"KV from layer {r.kv_source} · top-k from layer {r.index_source}"
    if r.in_candidate_pool:
        text += f" · inside layer {cfg.candidate_source_layer}'s candidate pool"
    return text


def global_branch_note(r: LayerRole, cfg: ModelConfig) -> str | None:
    """What the top-k section says instead of (or above) a map, by role."""
    if r.kv_source is None:
        return (f"Layer {r.layer} is SWA-only: it attends over its own {cfg.window_size}-token window and has no "
                "global branch, so there are no top-k selections to show.")
    if r.role == "reuse":
        return (f"Layer {r.layer} is a Reuse layer: it computes no selection of its own. It attends over layer "
                f"{r.kv_source}'s compressed KV with the top-{cfg.index_topk} that layer {r.index_source} chose "
                "(shown below).")
    return None


# -- probe access -------------------------------------------------------------------------------

CPU_ACTIVE_LIMIT = 2e9  # active parameters per token above which a CPU run of a prompt takes too long


def cpu_run_refusal(active_params_per_token: float, on_cpu: bool) -> str | None:
    """Why a live run is not started here, or None. The release model (16 B active per token) takes
    hours per prompt on a CPU: it belongs on GPUs behind `python -m engine serve`."""
    if not on_cpu or active_params_per_token <= CPU_ACTIVE_LIMIT:
        return None
    return (f"This checkpoint activates {active_params_per_token / 1e9:.1f} B parameters per token: a run on this "
            "CPU would take hours. Serve it on GPUs (`torchrun ... -m engine serve --checkpoint DIR`) and attach "
            "the app with EXPLORER_ENGINE_URL; the plan, diagram and tallies here work from its headers.")


def layer_probe(run: dict | None, layer: int) -> dict | None:
    """The probes of one layer, or None when the run did not record it."""
    if not run:
        return None
    layers = run.get("layers")
    if not isinstance(layers, dict):
        raise ProbeError("run has no 'layers' mapping")
    return layers.get(str(layer), layers.get(layer))


def image_mask(run: dict, probe: dict | None = None) -> list[bool]:
    T = len(run.get("tokens") or [])
    mask = (probe or {}).get("routing", {}).get("image_mask") if probe else None
    mask = mask if mask is not None else run.get("image_mask")
    return [bool(v) for v in mask] if mask is not None else [False] * T


def _rows(probe: dict, key: str, T: int) -> list:
    value = probe.get(key)
    if value is None:
        return []
    if len(value) != T:
        raise ProbeError(f"'{key}' has {len(value)} rows for {T} tokens")
    return value


# -- top-k --------------------------------------------------------------------------------------

@dataclass
class TopkModel:
    T: int
    ratio: int
    n_entries: int
    selected: list[list[int]]          # per query: selected entry ids (no padding)
    pool: list[list[int]] | None       # per query: candidate pool entry ids
    window: int
    pairs: tuple[np.ndarray, np.ndarray] = None       # every (query, selected entry), flat
    pool_pairs: tuple[np.ndarray, np.ndarray] | None = None  # every (query, pool entry), flat


def topk_model(run: dict, probe: dict) -> TopkModel | None:
    """The selections of one index-producing layer (its own or the one it borrows)."""
    T = len(run.get("tokens") or [])
    topk = _rows(probe, "topk", T)
    if not topk:
        return None
    m = int(probe.get("compress_ratio") or 1)
    try:
        picks = np.asarray(topk, dtype=np.int64).reshape(T, -1)
    except (TypeError, ValueError):  # ragged rows or nulls (hand-made runs): clean them first
        rows = [[int(j) for j in row if j is not None and int(j) >= 0] for row in topk]
        width = max(map(len, rows), default=0)
        picks = np.array([row + [-1] * (width - len(row)) for row in rows], dtype=np.int64).reshape(T, width)
    keep = picks >= 0
    pairs = (np.nonzero(keep)[0], picks[keep])
    selected = [row[row >= 0].tolist() for row in picks]
    pool_rows = probe.get("candidate_pool")
    pool, pool_pairs = None, None
    if pool_rows:
        lengths = np.fromiter(map(len, pool_rows), dtype=np.int64, count=len(pool_rows))
        flat = np.fromiter(chain.from_iterable(pool_rows), dtype=np.int64, count=int(lengths.sum()))
        pool, pool_pairs = pool_rows, (np.repeat(np.arange(len(pool_rows)), lengths), flat)
    top = max(int(pairs[1].max(initial=-1)), int(pool_pairs[1].max(initial=-1)) if pool_pairs else -1, T // m - 1, 0)
    return TopkModel(T, m, top + 1, selected, pool, int(probe.get("window_size") or 0), pairs, pool_pairs)


def entry_tokens(entry: int, ratio: int, T: int) -> range:
    """Prompt positions a global entry covers."""
    return range(entry * ratio, min(entry * ratio + ratio, T))


def selection_counts(model: TopkModel) -> list[int]:
    """Per prompt token: how many queries selected the entry that token belongs to."""
    per_entry = np.bincount(model.pairs[1], minlength=model.n_entries)
    entry_of = np.arange(model.T) // model.ratio
    return np.where(entry_of < model.n_entries, per_entry[np.minimum(entry_of, model.n_entries - 1)], 0).tolist()


def selected_positions(model: TopkModel, query: int) -> set[int]:
    """Prompt positions covered by the entries query `query` selected."""
    if not 0 <= query < model.T:
        raise ProbeError(f"query position {query} is outside the prompt (0..{model.T - 1})")
    return {t for j in model.selected[query] for t in entry_tokens(j, model.ratio, model.T)}


def topk_map(model: TopkModel) -> dict:
    """Binned map: z[qb][eb] = share of (query, entry) cells selected (2 = selected, 1 = in pool only)."""
    binned = _binned(model)
    return {**binned, "sel": binned["sel"].tolist(), "pool": binned["pool"].tolist()}


def _binned(model: TopkModel) -> dict:
    qb = max(1, -(-model.T // MAX_MAP_CELLS))
    eb = max(1, -(-model.n_entries // MAX_MAP_CELLS))
    nq, ne = -(-model.T // qb), -(-model.n_entries // eb)

    def share(pairs) -> np.ndarray:
        if pairs is None:
            return np.zeros((nq, ne))
        cells = np.bincount((pairs[0] // qb) * ne + pairs[1] // eb, minlength=nq * ne)
        return cells.reshape(nq, ne) / (qb * eb)

    return {"sel": share(model.pairs), "pool": share(model.pool_pairs), "q_bin": qb, "e_bin": eb}


def topk_figure(model: TopkModel, *, query: int | None = None, height: int = 380) -> Figure:
    """Query position (y) × global entry (x): selected cells dark, the candidate pool light, the
    sliding window's band outlined (entries the window already covers)."""
    binned = _binned(model)
    qb, eb = binned["q_bin"], binned["e_bin"]
    xs = np.arange(binned["sel"].shape[1]) * eb
    ys = np.arange(binned["sel"].shape[0]) * qb
    fig = Figure()
    if model.pool:  # no hover on the pool: one byte per cell is enough
        pool = np.rint(binned["pool"] * 255).astype(np.uint8)
        fig.add_trace(dict(type="heatmap", z=pool, x=xs, y=ys, showscale=False, hoverinfo="skip",
                           colorscale=[[0, "rgba(0,0,0,0)"], [1, "rgba(230,159,0,0.35)"]], zmin=0, zmax=255))
    fig.add_trace(dict(type="heatmap", z=binned["sel"].astype(np.float32), x=xs, y=ys, showscale=True, zmin=0,
                       zmax=1, colorscale=[[0, "rgba(0,0,0,0)"], [0.001, "#C6DBEF"], [1, "#08306B"]],
                       colorbar=dict(title=dict(text="share of<br>cell picked", side="top", font=dict(size=10)),
                                     thickness=8, len=0.75, x=1.0, xanchor="left", xpad=6, tickfont=dict(size=10)),
                       hovertemplate="query %{y} · entry %{x}<br>selected share %{z:.2f}<extra></extra>"))
    if model.window:  # the band's two edges, one line each way (NaN breaks the line between them)
        qs = np.arange(model.T, dtype=np.float32)
        lo = np.maximum(0, (qs - model.window + 1) // model.ratio)
        hi = qs // model.ratio
        gap = np.array([np.nan], dtype=np.float32)
        fig.add_trace(dict(type="scatter", x=np.concatenate([lo, gap, hi]), y=np.concatenate([qs, gap, qs]),
                           mode="lines", hoverinfo="skip", line=dict(color="#D55E00", width=1, dash="dot"),
                           name="window"))
    if query is not None and 0 <= query < model.T:
        fig.add_hline(y=query, line=dict(color=INK, width=1))
    fig.update_layout(**base_layout(
        height=height, margin=dict(l=62, r=70, t=8, b=44),
        xaxis=dict(title=dict(text=f"global entry (1 per {model.ratio} token{'s' if model.ratio > 1 else ''})",
                              font=dict(size=11, color=MUTED)), gridcolor=GRID, range=[-0.5, model.n_entries]),
        yaxis=dict(title=dict(text="query position", font=dict(size=11, color=MUTED)), gridcolor=GRID,
                   autorange="reversed"),
        hovermode="closest"))
    return fig


def token_strip_html(tokens: list[str], values: list[float] | None = None, *, highlight: set[int] = frozenset(),
                     focus: int | None = None, image: list[bool] | None = None, max_tokens: int = 2000) -> str:
    """The prompt as inline token chips: background by value (0..max), a yellow ring on `highlight`,
    an ink ring on `focus`, a dashed underline on image positions. Text is escaped."""
    values = values or [0.0] * len(tokens)
    top = max(values) if values and max(values) > 0 else 1.0
    chips = []
    for i, tok in enumerate(tokens[:max_tokens]):
        a = values[i] / top if i < len(values) else 0
        # shared looks live in the classes below; a chip carries only what is its own
        style = f"background:rgba(8,48,107,{0.08 + 0.72 * a:.2f})" + (";color:white" if a > 0.55 else "") \
            if a > 0 else ""
        marks = " ".join(name for name, on in (("hl", i in highlight), ("fo", i == focus),
                                                ("im", bool(image and i < len(image) and image[i]))) if on)
        text = html.escape(tok.replace("\n", "⏎").replace("\t", "⇥")) or "∅"
        chips.append(f"<span title='#{i} · {values[i] if i < len(values) else 0:g}'"
                     f"{f' class={chr(39)}{marks}{chr(39)}' if marks else ''}"
                     f"{f' style={chr(39)}{style}{chr(39)}' if style else ''}>{text}</span>")
    more = f"<span style='color:{MUTED}'> … {len(tokens) - max_tokens} more</span>" if len(tokens) > max_tokens else ""
    return f"<div class='strip'>{STRIP_CSS}{''.join(chips)}{more}</div>"


STRIP_CSS = (f"<style>.strip{{line-height:1.9;max-height:260px;overflow-y:auto}}"
             f".strip span{{background:#F3F4F6;color:{INK};border-radius:3px;padding:1px 2px;margin:1px;"
             "display:inline-block;font-family:ui-monospace,Menlo,monospace;font-size:12px;white-space:pre}"
             ".strip .hl{box-shadow:0 0 0 2px #E69F00}.strip .fo{outline:2px solid #1F2430}"
             ".strip .im{border-bottom:2px dashed #CC79A7}</style>")


# -- mHC ----------------------------------------------------------------------------------------

def mhc_token(probe: dict, t: int) -> dict:
    """One token's coefficients: {'attn'|'ffn': {'pre': [hc], 'post': [hc], 'comb': [[hc]*hc]}}."""
    out = {}
    for part, d in (probe.get("mhc") or {}).items():
        if not 0 <= t < len(d.get("pre", [])):
            raise ProbeError(f"token {t} is outside the mHC probe of '{part}'")
        out[part] = {k: d[k][t] for k in ("pre", "post", "comb") if k in d}
    return out


def mhc_token_figure(probe: dict, t: int, height: int = 300) -> Figure:
    """Pre and post bars of both sub-layers, and the two comb mixes, for one token. Panels are laid
    out on plain axis domains (make_subplots costs ~25 ms per draw here); mix values are in the hover."""
    coeff = mhc_token(probe, t)
    parts = [p for p in ("attn", "ffn") if p in coeff]
    n = 2 + len(parts)
    gap = 0.07
    width = (1 - gap * (n - 1)) / n
    titles = ["pre (collapse)", "post (write back)"] + [f"comb {p} (i → j)" for p in parts]
    fig = Figure()
    layout = {}
    for i in range(n):
        suffix = "" if i == 0 else str(i + 1)
        left = i * (width + gap)
        layout[f"xaxis{suffix}"] = dict(domain=[left, left + width], anchor=f"y{suffix}")
        layout[f"yaxis{suffix}"] = dict(anchor=f"x{suffix}", gridcolor=GRID, **(
            {"autorange": "reversed"} if i >= 2 else {}))
    for col, key in ((0, "pre"), (1, "post")):
        for k, part in enumerate(parts):
            vals = coeff[part][key]
            fig.add_trace(dict(type="bar", x=[f"c{i}" for i in range(len(vals))], y=vals, name=part,
                               xaxis=f"x{col + 1 if col else ''}", yaxis=f"y{col + 1 if col else ''}",
                               marker=dict(color=(MHC_COLOUR, "#9CA3AF")[k]), showlegend=col == 0,
                               hovertemplate=f"{part} {key} copy %{{x}}: %{{y:.4f}}<extra></extra>"))
    for k, part in enumerate(parts):
        comb = coeff[part].get("comb")
        if comb:
            last = k == len(parts) - 1   # one colour scale for both comb panels (same 0-1 range)
            fig.add_trace(dict(type="heatmap", z=comb, colorscale=PURPLES, zmin=0, zmax=1, showscale=last,
                               **({"colorbar": dict(title=dict(text="weight", side="top", font=dict(size=10)),
                                                    thickness=8, len=0.8, x=1.0, xanchor="left", xpad=4,
                                                    tickfont=dict(size=10))} if last else {}),
                               xaxis=f"x{3 + k}", yaxis=f"y{3 + k}",
                               hovertemplate="from copy %{y} to copy %{x}: %{z:.4f}<extra></extra>"))
    annotations = [dict(text=title, x=i * (width + gap) + width / 2, y=1.0, xref="paper", yref="paper",
                        xanchor="center", yanchor="bottom", showarrow=False, font=dict(size=11, color=MUTED))
                   for i, title in enumerate(titles)]
    fig.update_layout(**base_layout(height=height, showlegend=True, barmode="group", annotations=annotations,
                                    margin=dict(l=44, r=52, t=28, b=30),
                                    legend=dict(orientation="h", y=-0.12, font=dict(size=11)), **layout))
    return fig


def mhc_lines_figure(probe: dict, tokens: list[str], part: str = "attn", height: int = 260) -> Figure:
    """Across tokens: pre and post per residual copy (solid pre, dotted post)."""
    d = (probe.get("mhc") or {}).get(part) or {}
    fig = Figure()
    for key, dash in (("pre", "solid"), ("post", "dot")):
        rows = np.asarray(d.get(key) or [], dtype=np.float32)  # numpy: shipped as one binary block
        for c in range(rows.shape[1] if rows.ndim == 2 else 0):
            fig.add_trace(dict(type="scatter", y=rows[:, c], mode="lines", name=f"{key} c{c}",
                               line=dict(color=COPY_COLOURS[c % len(COPY_COLOURS)], dash=dash, width=1.3),
                               **_token_hover(fig, tokens, f"{key} c{c}", ".4f")))
    fig.update_layout(**base_layout(height=height, showlegend=True, margin=dict(l=52, r=8, t=8, b=44),
                                    legend=dict(orientation="h", y=1.02, yanchor="bottom", font=dict(size=10)),
                                    xaxis=dict(title=dict(text="token", font=dict(size=11, color=MUTED)), gridcolor=GRID),
                                    yaxis=dict(gridcolor=GRID, title=dict(text="mHC weight", font=dict(size=11, color=MUTED))),
                                    hovermode="x unified"))
    return fig


def _token_hover(fig: Figure, tokens: list[str], name: str, fmt: str) -> dict:
    """Hover for one line of a per-token chart with unified hover: the first line carries the token
    texts (once per chart, not once per line)."""
    if not fig.data:
        return dict(customdata=tokens, hovertemplate=f"%{{customdata}} · {name}: %{{y:{fmt}}}<extra></extra>")
    return dict(hovertemplate=f"{name}: %{{y:{fmt}}}<extra></extra>")


def residual_norms_figure(probe: dict, tokens: list[str], height: int = 220) -> Figure:
    rows = np.asarray(probe.get("residual_norms") or [], dtype=np.float32)
    fig = Figure()
    for c in range(rows.shape[1] if rows.ndim == 2 else 0):
        fig.add_trace(dict(type="scatter", y=rows[:, c], mode="lines", name=f"copy {c}",
                           line=dict(color=COPY_COLOURS[c % len(COPY_COLOURS)], width=1.3),
                           **_token_hover(fig, tokens, f"copy {c}", ".3g")))
    fig.update_layout(**base_layout(height=height, showlegend=True, margin=dict(l=52, r=8, t=8, b=44),
                                    legend=dict(orientation="h", y=1.02, yanchor="bottom", font=dict(size=10)),
                                    xaxis=dict(gridcolor=GRID), yaxis=dict(gridcolor=GRID, title=dict(text="‖X[c]‖")),
                                    hovermode="x unified"))
    return fig


def side_by_side(left: Figure, right: Figure, share: float = 0.55, gap: float = 0.07) -> Figure:
    """Two single-panel figures as one chart, left and right (one Plotly draw instead of two: in the
    browser each chart costs ~30-100 ms to draw after every click). Axes, traces and hover are kept;
    the layout is the left figure's (margins, hovermode), the taller height, either one's legend."""
    lay, right_lay = left.layout, right.layout
    layout = dict(lay, xaxis=dict(lay.get("xaxis") or {}, domain=[0, share - gap / 2]),
                  yaxis=dict(lay.get("yaxis") or {}, anchor="x"),
                  xaxis2=dict(right_lay.get("xaxis") or {}, domain=[share + gap / 2, 1], anchor="y2"),
                  yaxis2=dict(right_lay.get("yaxis") or {}, anchor="x2"),
                  height=max(lay.height or 0, right_lay.height or 0) or None,
                  showlegend=bool(lay.showlegend or right_lay.showlegend))
    if right_lay.showlegend and not lay.showlegend:   # the right panel's legend stays over the right panel
        layout["legend"] = dict(right_lay.get("legend") or {}, x=share + gap / 2, xanchor="left")
    return Figure(list(left.data) + [dict(t, xaxis="x2", yaxis="y2") for t in right.data], layout)


# -- routing ------------------------------------------------------------------------------------

@dataclass
class RoutingModel:
    T: int
    n_experts: int
    experts: list[list[int]]
    weights: list[list[float]]
    image: list[bool]

    def load(self, image: bool | None = None) -> list[int]:
        """Tokens routed to each expert (optionally only text or only image tokens)."""
        out = [0] * self.n_experts
        for t, row in enumerate(self.experts):
            if image is None or self.image[t] == image:
                for e in row:
                    out[e] += 1
        return out

    def matrix(self) -> np.ndarray:
        """[T, E] float32 routing weights (0 where an expert is not chosen)."""
        z = np.zeros((self.T, self.n_experts), dtype=np.float32)
        cells = [(t, e, w) for t, (es, ws) in enumerate(zip(self.experts, self.weights)) for e, w in zip(es, ws)]
        if cells:
            rows, experts, weights = zip(*cells)
            z[list(rows), list(experts)] = weights
        return z


def routing_model(run: dict, probe: dict, n_experts: int) -> RoutingModel | None:
    T = len(run.get("tokens") or [])
    r = probe.get("routing") or {}
    experts, weights = r.get("experts"), r.get("weights")
    if experts is None or weights is None:
        return None
    if len(experts) != T or len(weights) != T:
        raise ProbeError(f"routing has {len(experts)} rows for {T} tokens")
    scores = r.get("scores")
    n = max(n_experts, len(scores[0]) if scores else 0, max((max(row) for row in experts if row), default=-1) + 1)
    return RoutingModel(T, n, [[int(e) for e in row] for row in experts],
                        [[float(w) for w in row] for row in weights], image_mask(run, probe))


def routing_heatmap(model: RoutingModel, tokens: list[str], height: int = 320, colorbar_x: float = 1.0) -> Figure:
    """Token (row) x routed expert (column): routing weight, 0 where not chosen. `colorbar_x`: where the
    colour scale stands in paper coordinates (beside the left panel of a side_by_side)."""
    z = model.matrix()   # numpy: shipped as one binary block
    scale = dict(showscale=True, colorbar=dict(title=dict(text="routing<br>weight", side="top", font=dict(size=10)),
                                               thickness=8, len=0.75, x=colorbar_x, xanchor="left", xpad=4,
                                               tickfont=dict(size=10)))
    # a long prompt's rows are averaged in bins (the chart has ~300 px for them; every token's experts
    # are in the table below); token text on the y axis ticks would crowd, the hover names positions
    per = max(1, -(-model.T // MAX_MAP_CELLS))
    if per > 1:
        padded = np.zeros((-(-model.T // per) * per, z.shape[1]), dtype=np.float32)
        padded[:model.T] = z
        counts = np.minimum(per, model.T - np.arange(0, model.T, per))[:, None]
        z = padded.reshape(-1, per, z.shape[1]).sum(1) / counts
        starts = np.arange(0, model.T, per)
        # a heatmap's customdata is read per cell: one row per bin, the bin's last token in every column
        ends = np.repeat((np.minimum(starts + per, model.T) - 1).astype(np.int32)[:, None], z.shape[1], axis=1)
        fig = Figure([dict(type="heatmap", z=z, y=starts, customdata=ends,
                           colorscale=BLUES, zmin=0, **scale,
                           hovertemplate="tokens %{y}-%{customdata} · expert %{x}: mean weight %{z:.3f}"
                                         "<extra></extra>")])
    else:
        fig = Figure([dict(type="heatmap", z=z, colorscale=BLUES, zmin=0, **scale,
                           hovertemplate="token %{y} · expert %{x}: weight %{z:.3f}<extra></extra>")])
    fig.update_layout(**base_layout(height=height, margin=dict(l=62, r=8, t=8, b=44),
                                    xaxis=dict(title=dict(text="routed expert", font=dict(size=11, color=MUTED))),
                                    yaxis=dict(title=dict(text="token", font=dict(size=11, color=MUTED)),
                                               autorange="reversed")))
    return fig


def expert_load_figure(model: RoutingModel, height: int = 220) -> Figure:
    """Tokens per expert, text and image stacked (they balance with separate biases)."""
    fig = Figure()
    fig.add_trace(dict(type="bar", y=model.load(image=False), name="text tokens (bias)",
                       marker=dict(color=ROLE_COLOURS["full_m2"]),
                       hovertemplate="expert %{x}: %{y} text tokens<extra></extra>"))
    if any(model.image):
        fig.add_trace(dict(type="bar", y=model.load(image=True), name="image tokens (bias_vl)",
                           marker=dict(color="#CC79A7"), hovertemplate="expert %{x}: %{y} image tokens<extra></extra>"))
    fig.update_layout(**base_layout(height=height, barmode="stack", showlegend=True, bargap=0.05,
                                    margin=dict(l=52, r=8, t=8, b=44),
                                    legend=dict(orientation="h", y=1.02, yanchor="bottom", font=dict(size=10)),
                                    xaxis=dict(title=dict(text="routed expert", font=dict(size=11, color=MUTED))),
                                    yaxis=dict(gridcolor=GRID)))
    return fig


def token_routes(model: RoutingModel, tokens: list[str]) -> list[dict]:
    """Each token's top-k experts with weights, strongest first (a table)."""
    out = []
    for t in range(model.T):
        pairs = sorted(zip(model.experts[t], model.weights[t]), key=lambda p: -p[1])
        out.append({"pos": t, "token": tokens[t], "image": model.image[t],
                    "experts": " ".join(f"{e}:{w:.3f}" for e, w in pairs), "weight sum": round(sum(model.weights[t]), 4)})
    return out


def bias_split(model: RoutingModel) -> dict:
    """How many distinct experts text and image tokens use, and how many they share."""
    text = {e for t, row in enumerate(model.experts) if not model.image[t] for e in row}
    image = {e for t, row in enumerate(model.experts) if model.image[t] for e in row}
    return {"text_tokens": model.image.count(False), "image_tokens": model.image.count(True),
            "text_experts": len(text), "image_experts": len(image), "shared_experts_used": len(text & image)}


# -- downloads ----------------------------------------------------------------------------------

def layer_json(run: dict, layer: int) -> str:
    probe = layer_probe(run, layer)
    if probe is None:
        raise ProbeError(f"the run has no probes for layer {layer}")
    return json.dumps({"tokens": run.get("tokens"), "token_ids": run.get("token_ids"), "layer": layer, **probe})


def layer_csv(run: dict, layer: int) -> str:
    """One row per token: position, token, image flag, selected entries, experts/weights, mHC pre/post,
    residual norms."""
    probe = layer_probe(run, layer)
    if probe is None:
        raise ProbeError(f"the run has no probes for layer {layer}")
    tokens = run.get("tokens") or []
    T = len(tokens)
    img = image_mask(run, probe)
    topk = _rows(probe, "topk", T)
    r = probe.get("routing") or {}
    mhc = probe.get("mhc") or {}
    norms = _rows(probe, "residual_norms", T)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["pos", "token", "token_id", "image", "topk_entries", "experts", "expert_weights",
                "attn_pre", "attn_post", "ffn_pre", "ffn_post", "residual_norms"])
    ids = run.get("token_ids") or [None] * T
    for t in range(T):
        def col(part, key):
            rows = (mhc.get(part) or {}).get(key)
            return " ".join(f"{v:.6g}" for v in rows[t]) if rows else ""
        w.writerow([t, tokens[t], ids[t], int(img[t]),
                    " ".join(str(j) for j in topk[t] if j is not None and j >= 0) if topk else "",
                    " ".join(map(str, r["experts"][t])) if r.get("experts") else "",
                    " ".join(f"{v:.6g}" for v in r["weights"][t]) if r.get("weights") else "",
                    col("attn", "pre"), col("attn", "post"), col("ffn", "pre"), col("ffn", "post"),
                    " ".join(f"{v:.6g}" for v in norms[t]) if norms else ""])
    return buf.getvalue()


# -- kernel parity (engine/run/parity.py layer_parity rows) ----------------------------------------

PARITY_COLUMNS = ("kernel", "case", "max abs diff", "max rel diff", "rel L2", "bound (rel L2)", "verdict")


def parity_table(rows: list[dict]) -> list[dict]:
    """`layer_parity` rows -> display rows. Verdict against the METHOD page's bounds (the row's `bound`);
    the indexer top-k row counts query rows whose picks differ (max abs) and their share (max rel)."""
    out = []
    for r in rows:
        for key in ("kernel", "case", "max_abs", "max_rel", "rel_l2", "ok"):
            if key not in r:
                raise ProbeError(f"a parity row has no '{key}'")
        bound = r.get("bound")
        if r["kernel"] == "indexer_topk":
            bound_text = "same picks (ties aside)"
        elif r["kernel"] == "quantize_fp4":
            bound_text = "bit-exact"
        else:
            bound_text = "-" if bound is None else f"{bound:.0e}"
        out.append({"kernel": r["kernel"], "case": r["case"], "max abs diff": _sci(r["max_abs"]),
                    "max rel diff": _sci(r["max_rel"]), "rel L2": _sci(r["rel_l2"]), "bound (rel L2)": bound_text,
                    "verdict": "within bound" if r["ok"] else "OVER bound"})
    return out


def _sci(v) -> str:
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        return str(v)
    return "0" if v == 0 else f"{v:.2e}"


def parity_summary(rows: list[dict]) -> str:
    bad = [r for r in rows if not r["ok"]]
    if not rows:
        return "The run recorded no kernel inputs for this layer."
    if not bad:
        return f"All {len(rows)} kernel checks are within their bounds."
    return f"{len(bad)} of {len(rows)} kernel checks are OVER their bounds: " + \
        ", ".join(sorted({f"{r['kernel']} ({r['case']})" for r in bad}))


def parity_mode(on_cuda: bool, interpreter_possible: bool, cost: float, limit: float, rows: int) -> tuple[str, str]:
    """How the app can run the check: ("cuda" | "interpreter" | "none", the sentence to show)."""
    if on_cuda:
        return "cuda", "Runs the layer's real inputs through each Triton kernel and its PyTorch reference on the GPU."
    if not interpreter_possible:
        return "none", ("The Triton path needs CUDA: this engine runs on the CPU, and the Triton interpreter can no "
                        "longer be enabled in this process (triton was imported without it).")
    if cost > limit:
        return "none", (f"The Triton path needs CUDA: this engine runs on the CPU, and this layer's check is too "
                        f"large for the Triton interpreter (about {cost:.1e} multiply-adds; the limit is {limit:.0e}).")
    return "interpreter", (f"No CUDA here: the Triton kernels run under the CPU interpreter, on the last {rows} "
                           "tokens of each kernel call (the layer's real inputs from the prompt).")
