"""The layer plan: every backbone layer as a clickable square, layer 0 at the bottom, the DSpark stages
apart on top, coloured by role, with arcs from each borrowing layer to the layer it borrows from.

Left arcs: whose compressed KV (and index keys) a layer reads. Right arcs: whose top-k it uses (solid)
or whose candidate pool it scores inside (dotted). Everything comes from `role_plan` / `cache_graph`.
"""

from __future__ import annotations

import textwrap

from dataclasses import dataclass

import networkx as nx

from engine.config import ModelConfig
from engine.roles import TAB_TITLES, TABS, LayerRole, cache_graph, decoder_start, role_plan

from .figure import Figure
from .style import DSPARK_COLOUR, ENGRAM_COLOUR, INK, MUTED, ROLE_COLOURS, base_layout, fmt_params

BLOCK_TRACE = "layers"      # name of the one clickable trace (its points carry customdata [layer, role])
BLOCK_X = 0.0
DSPARK_GAP = 1.5            # vertical gap between the backbone and the DSpark stages


@dataclass(frozen=True)
class Edge:
    reader: int
    source: int
    reads: tuple[str, ...]
    side: str               # "kv" (left) | "topk" | "candidates" | "dspark_tap" (right)


def y_of(layer: int, cfg: ModelConfig) -> float:
    """Vertical position: backbone layers at their index, DSpark stages above a gap."""
    return float(layer) if layer < cfg.n_layers else layer + DSPARK_GAP


def plan_edges(cfg: ModelConfig, plan: list[LayerRole] | None = None) -> list[Edge]:
    """The arcs to draw, one per (reader, source, side), from the cache graph."""
    plan = plan or role_plan(cfg)
    graph: nx.DiGraph = cache_graph(cfg, plan)
    edges: list[Edge] = []
    for reader, source, data in sorted(graph.edges(data=True)):
        reads = tuple(data["reads"])
        if "kv" in reads or "index_keys" in reads:
            edges.append(Edge(reader, source, tuple(r for r in reads if r in ("kv", "index_keys")), "kv"))
        if "topk" in reads:
            edges.append(Edge(reader, source, ("topk",), "topk"))
        if "candidates" in reads:
            edges.append(Edge(reader, source, ("candidates",), "candidates"))
        if "dspark_tap" in reads:
            edges.append(Edge(reader, source, ("dspark_tap",), "dspark_tap"))
    return edges


def describe_layer(r: LayerRole, cfg: ModelConfig) -> str:
    """One line on where a layer's global attention comes from."""
    if r.is_dspark:
        return f"DSpark draft stage {r.layer - cfg.n_layers}: window only"
    if r.role == "swa":
        return f"{cfg.window_size}-token window only, no global branch"
    kv = "self" if r.kv_source == r.layer else f"layer {r.kv_source}"
    topk = "self" if r.index_source == r.layer else f"layer {r.index_source}"
    text = f"KV from {kv} · top-k from {topk}"
    if r.role == "reindex":
        text += f" · index keys from layer {r.index_key_source}"
    if r.in_candidate_pool:
        text += f" (inside layer {cfg.candidate_source_layer}'s pool)"
    if r.candidate_source:
        text += f" · publishes the candidate pool ({cfg.candidate_topk_blocks} blocks × {cfg.candidate_block_size})"
    return text


def _arc(x0: float, y0: float, y1: float, side: int, scale: float) -> tuple[list, list]:
    """A quadratic curve from (x0, y0) to (x0, y1) bulging sideways by sqrt of the distance."""
    bulge = side * (0.35 + scale * abs(y1 - y0) ** 0.5)
    xs, ys = [], []
    for i in range(17):
        t = i / 16
        xs.append((1 - t) ** 2 * x0 + 2 * (1 - t) * t * (x0 + 2 * bulge) + t ** 2 * x0)
        ys.append((1 - t) ** 2 * y0 + 2 * (1 - t) * t * (y0 + y1) / 2 + t ** 2 * y1)
    return xs + [None], ys + [None]


HOVER_CHARS = 14   # characters per hover line: the box fits beside the block in a ~230 px plan


def _hover(r: LayerRole, cfg: ModelConfig, params: int | None) -> str:
    title = f"DSpark stage {r.layer - cfg.n_layers}" if r.is_dspark else f"Layer {r.layer}"
    lines = [f"<b>{title}</b>", r.label, describe_layer(r, cfg)]
    if r.compress_ratio:
        lines.append(f"compress ratio m={r.compress_ratio}")
    if r.engram:
        lines.append("Engram lookup added before this layer")
    if r.dspark_tap:
        lines.append("DSpark reads this layer's input stream")
    if params is not None:
        lines.append(f"{fmt_params(params)} parameters")
    # narrow lines: the box must fit beside the block (a wide one was clipped by the chart's edge and
    # slid over the block it describes); the bold title ("Layer 24", "DSpark stage 1") stays whole
    wrapped = [lines[0]] + [part for line in lines[1:]
                            for part in textwrap.wrap(line, HOVER_CHARS, break_long_words=False)]
    return "<br>".join(wrapped + ["<i>click to open</i>"])


def plan_figure(cfg: ModelConfig, plan: list[LayerRole] | None = None, *,
                layer_params: dict[int, int] | None = None, selected: int | None = None,
                height: int = 860) -> Figure:
    """The clickable plan. Trace order is fixed: arcs, Engram markers, role names, then the blocks
    (named BLOCK_TRACE, last), so the blocks are on top and the browser test can find layer L as
    point L of the last scatter trace."""
    plan = plan or role_plan(cfg)
    layer_params = layer_params or {}
    fig = Figure()
    n, split = cfg.n_layers, decoder_start(cfg)
    top = y_of(len(plan) - 1, cfg) if len(plan) > n else n - 1

    # halves as faint bands with their names on the left
    bands = [("encoder", -0.5, split - 0.5, "#EEF4FB"), ("decoder", split - 0.5, n - 0.5, "#FBF1EA")]
    if len(plan) > n:
        bands.append(("DSpark", y_of(n, cfg) - 0.5, top + 0.5, "#F8EEF5"))
    for name, y0, y1, fill in bands:
        if y1 <= y0:
            continue
        fig.add_shape(type="rect", x0=-4.4, x1=4.4, y0=y0, y1=y1, fillcolor=fill, line=dict(width=0), layer="below")
        label = f"{name} · {int(y0 + 0.5)}–{int(y1 - 0.5)}" if name != "DSpark" else "DSpark"
        fig.add_annotation(x=-4.3, y=(y0 + y1) / 2, text=label, showarrow=False, textangle=-90,
                           font=dict(size=11, color=MUTED), xanchor="left")

    # arcs, one trace per kind so the legend below the figure can explain them
    styles = {"kv": (-1, 1.6, "solid", "reads KV"), "topk": (1, 1.6, "solid", "top-k"),
              "candidates": (1, 1.2, "dot", "candidate pool"), "dspark_tap": (1, 1.2, "dot", "DSpark tap")}
    by_layer = {r.layer: r for r in plan}
    for side_name, (side, width, dash, _) in styles.items():
        groups: dict[str, tuple[list, list]] = {}
        for e in plan_edges(cfg, plan):
            if e.side != side_name:
                continue
            colour = DSPARK_COLOUR if side_name == "dspark_tap" else ROLE_COLOURS[by_layer[e.source].tab]
            xs, ys = _arc(BLOCK_X + side * 0.45, y_of(e.reader, cfg), y_of(e.source, cfg), side,
                          0.42 if side_name != "candidates" else 0.5)
            gx, gy = groups.setdefault(colour, ([], []))
            gx.extend(xs)
            gy.extend(ys)
        for colour, (xs, ys) in groups.items():
            fig.add_trace(dict(type="scatter", x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                               line=dict(color=colour, width=width, dash=dash), opacity=0.75,
                               name=f"arcs:{side_name}"))

    # Engram taps: a green diamond between layer L-1 and L
    engram = [r for r in plan if r.engram]
    if engram:
        fig.add_trace(dict(
            type="scatter", x=[BLOCK_X - 0.62] * len(engram), y=[r.layer - 0.5 for r in engram], mode="markers+text",
            marker=dict(symbol="diamond", size=11, color=ENGRAM_COLOUR, line=dict(color="white", width=1)),
            text=["Engram"] * len(engram), textposition="middle left",
            textfont=dict(size=10, color=ENGRAM_COLOUR), hoverinfo="text",
            hovertext=[f"Engram lookup added to the stream before layer {r.layer}" for r in engram],
            name="engram"))

    # The selection ring is a layout shape under the blocks (a click always lands on a block), so a new
    # selection changes only the layout and the browser redraws it without redrawing the traces.
    if selected is not None and selected in by_layer:
        fig.add_shape(type="rect", name="ring", layer="below", xsizemode="pixel", ysizemode="pixel",
                      xanchor=BLOCK_X, yanchor=y_of(selected, cfg), x0=-13.5, x1=13.5, y0=-13.5, y1=13.5,
                      fillcolor=INK, line=dict(width=0))

    # role names of the interesting layers, far right (one text trace: cheaper to draw than annotations)
    named = [r for r in plan if r.role in ("full", "reindex") or r.is_dspark and r.layer == n]
    fig.add_trace(dict(
        type="scatter", mode="text", hoverinfo="skip", name="names", x=[4.3] * len(named),
        y=[y_of(r.layer, cfg) for r in named], textposition="middle left",
        text=["DSpark stages" if r.is_dspark else f"{r.layer} {r.label}" for r in named],
        textfont=dict(size=10, color=[DSPARK_COLOUR if r.is_dspark else ROLE_COLOURS[r.tab] for r in named])))

    ys = [y_of(r.layer, cfg) for r in plan]
    fig.add_trace(dict(
        type="scatter", x=[BLOCK_X] * len(plan), y=ys, mode="markers+text",
        marker=dict(symbol="square", size=19, color=[ROLE_COLOURS[r.tab] for r in plan],
                    line=dict(color=[DSPARK_COLOUR if r.is_dspark else "white" for r in plan], width=1.5)),
        text=[str(r.layer - n) if r.is_dspark else str(r.layer) for r in plan],
        textposition="middle center", textfont=dict(size=9, color="white"),
        customdata=[[r.layer, r.role] for r in plan],
        hovertext=[_hover(r, cfg, layer_params.get(r.layer)) for r in plan], hoverinfo="text",
        name=BLOCK_TRACE,
    ))


    fig.update_layout(**base_layout(
        height=height, margin=dict(l=4, r=4, t=4, b=4),
        xaxis=dict(range=[-4.45, 4.45], visible=False, fixedrange=True),
        yaxis=dict(range=[-1, top + 1], visible=False, fixedrange=True),
        clickmode="event", hovermode="closest", hoverlabel=dict(font=dict(size=10)),
    ))
    return fig


def plan_legend(plan: list[LayerRole]) -> list[dict]:
    """Legend entries (tab, title, colour, layer count) for the roles present, in tab order."""
    counts = {tab: 0 for tab in TABS}
    for r in plan:
        if not r.is_dspark:
            counts[r.tab] += 1
    return [dict(tab=t, title=TAB_TITLES[t], colour=ROLE_COLOURS[t], count=counts[t]) for t in TABS if counts[t]]


def legend_html(plan: list[LayerRole]) -> str:
    """A compact HTML legend (Plotly's own legend cannot colour one trace's points separately)."""
    chips = [f"<span style='display:inline-flex;align-items:center;margin:0 10px 4px 0;white-space:nowrap'>"
             f"<span style='width:11px;height:11px;background:{e['colour']};display:inline-block;"
             f"border-radius:2px;margin-right:5px'></span>{e['title']} <span style='color:{MUTED}'>"
             f"&nbsp;×{e['count']}</span></span>" for e in plan_legend(plan)]
    chips.append(f"<span style='display:inline-flex;align-items:center;margin:0 10px 4px 0'>"
                 f"<span style='color:{ENGRAM_COLOUR};margin-right:4px'>◆</span>Engram</span>")
    chips.append(f"<span style='color:{MUTED};font-size:0.85em'>left arcs: KV read · right arcs: top-k "
                 f"(dotted: candidate pool, DSpark taps)</span>")
    return f"<div style='font-size:0.82rem;line-height:1.5;color:{INK}'>{''.join(chips)}</div>"

