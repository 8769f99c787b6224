"""The tally margin and the diagram's parentheticals, both read from `engine.tally` rows.

`margin_lines(tally, position)` groups the tally's rows into a dozen readable lines that sum exactly
to the shown total; each line names the diagram boxes it covers, so a click can highlight them.
`box_stats(tally, layer)` gives each diagram box its parameters, dtype, bytes and active share.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


from engine.tally import Tally, TallyRow

from .diagram import BoxStat
from .figure import Figure
from .state import POSITION_TITLES, POSITIONS
from .style import GRID, HIGHLIGHT, INK, MUTED, ROLE_COLOURS, base_layout, fmt_params

# diagram box id -> the tally kinds (TallyRow.box) it draws
BOX_KINDS: dict[str, tuple[str, ...]] = {
    "hc_attn": ("mhc.attn_fn", "mhc.attn_base", "mhc.attn_scale"),
    "attn_norm": ("norm.attn",),
    "wq_a": ("attn.wq_a",),
    "q_norm": ("attn.q_norm",),
    "wq_b": ("attn.wq_b",),
    "wkv": ("attn.wkv",),
    "kv_norm": ("attn.kv_norm",),
    "compressor_wkv": ("attn.compressor.wkv",),
    "compressor_wgate": ("attn.compressor.wgate",),
    "compressor_norm": ("attn.compressor.norm",),
    "indexer_wk": ("attn.indexer.wk",),
    "indexer_k_norm": ("attn.indexer.k_norm",),
    "indexer_wq_b": ("attn.indexer.wq_b",),
    "indexer_weights_proj": ("attn.indexer.weights_proj",),
    "attn_sink": ("attn.attn_sink",),
    "wo_a": ("attn.wo_a",),
    "wo_b": ("attn.wo_b",),
    "hc_ffn": ("mhc.ffn_fn", "mhc.ffn_base", "mhc.ffn_scale"),
    "ffn_norm": ("norm.ffn",),
    "gate": ("ffn.gate", "ffn.gate.bias", "ffn.gate.bias_vl"),
    "experts": ("ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3"),
    "shared_experts": ("ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"),
    "engram": ("engram.embed", "engram.wkv", "engram.q_weight", "engram.k_weight"),
}
KIND_TO_BOX = {kind: box for box, kinds in BOX_KINDS.items() for kind in kinds}

# margin lines: (id, title, test on a row); first match wins, the last line catches everything left
_LINES: list[tuple[str, str]] = [
    ("experts", "Routed experts"),
    ("shared", "Shared expert"),
    ("q_path", "Q path (wq_a, q_norm, wq_b)"),
    ("output", "Output (wo_a, wo_b)"),
    ("kv_path", "KV path (wkv, kv_norm, sinks)"),
    ("compressor", "Compressor (Full layers)"),
    ("indexer", "Indexer (keys and queries)"),
    ("gate", "Gate (bias, bias_vl)"),
    ("mhc", "mHC mixes"),
    ("norms", "Norms"),
    ("engram_tables", "Engram tables"),
    ("engram_proj", "Engram projection"),
    ("embed", "Embedding"),
    ("head", "Head"),
    ("vision", "Vision tower"),
    ("dspark", "DSpark stages"),
    ("other", "Other"),
]
LINE_TITLES = dict(_LINES)


def line_of(row: TallyRow) -> str:
    """Which margin line a tally row belongs to."""
    kind, group = row.box, row.group
    if group == "dspark" or kind.startswith("dspark."):
        return "dspark"
    if group == "vision":
        return "vision"
    if kind.startswith("ffn.experts."):
        return "experts"
    if kind.startswith("ffn.shared_experts."):
        return "shared"
    if kind in ("attn.wq_a", "attn.q_norm", "attn.wq_b"):
        return "q_path"
    if kind in ("attn.wo_a", "attn.wo_b"):
        return "output"
    if kind in ("attn.wkv", "attn.kv_norm", "attn.attn_sink"):
        return "kv_path"
    if kind.startswith("attn.compressor."):
        return "compressor"
    if kind.startswith("attn.indexer."):
        return "indexer"
    if kind.startswith("ffn.gate"):
        return "gate"
    if group == "mhc":
        return "mhc"
    if kind.startswith("norm."):
        return "norms"
    if kind == "engram.embed":
        return "engram_tables"
    if group == "engram":
        return "engram_proj"
    if group == "embedding":
        return "embed"
    if kind == "head":
        return "head"
    return "other"


@dataclass(frozen=True)
class MarginLine:
    id: str
    title: str
    value: int | float            # parameters at the chosen position
    boxes: tuple[str, ...]        # diagram boxes it covers
    kinds: tuple[str, ...]        # tally kinds it sums
    note: str                     # what it is, for the hover


def row_value(row: TallyRow, position: str) -> Fraction:
    if position == "total":
        return Fraction(row.total_params)
    if position == "decode":
        return Fraction(row.active_decode_params)
    if position == "prefill":
        return Fraction(row.active_prefill_params)
    raise ValueError(f"unknown tally position {position!r}; expected one of {', '.join(POSITIONS)}")


def position_total(tally: Tally, position: str) -> int | float:
    """The headline figure of a position, as the tally computed it."""
    totals = {"total": tally.total_params, "decode": tally.active_decode_params,
              "prefill": tally.active_prefill_params}
    if position not in totals:
        raise ValueError(f"unknown tally position {position!r}; expected one of {', '.join(POSITIONS)}")
    return totals[position]


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def margin_lines(tally: Tally, position: str) -> list[MarginLine]:
    """The margin's lines at one position, largest first; lines worth 0 at this position are dropped.
    Their values sum exactly to `position_total` (summed as fractions, then rounded once per line)."""
    sums: dict[str, Fraction] = {}
    kinds: dict[str, list[str]] = {}
    for row in tally.rows:
        line = line_of(row)
        sums[line] = sums.get(line, Fraction(0)) + row_value(row, position)
        if row.box not in kinds.setdefault(line, []):
            kinds[line].append(row.box)
    out = []
    for line_id, title in _LINES:
        value = sums.get(line_id, Fraction(0))
        if value == 0:
            continue
        boxes = tuple(dict.fromkeys(KIND_TO_BOX[k] for k in kinds[line_id] if k in KIND_TO_BOX))
        note = "boxes: " + ", ".join(boxes) if boxes else "not drawn in the block diagram"
        out.append(MarginLine(line_id, title, _number(value), boxes, tuple(kinds[line_id]), note))
    out.sort(key=lambda l: -float(l.value))
    return out


def layer_params(tally: Tally) -> dict[int, int]:
    """Parameters each backbone layer owns (for the plan's hover)."""
    layers = sorted({layer for r in tally.rows for layer in r.layers})
    return {layer: tally.layer_params(layer) for layer in layers}


def box_stats(tally: Tally, layer: int) -> dict[str, BoxStat]:
    """Each diagram box's figures for one backbone layer (rows that do not include it are skipped)."""
    acc: dict[str, dict] = {}
    for row in tally.rows:
        box = KIND_TO_BOX.get(row.box)
        if box is None or layer not in row.layers:
            continue
        share = len(row.layers)
        a = acc.setdefault(box, {"params": 0, "bytes": 0, "active": Fraction(0), "matmul": Fraction(0),
                                 "fmts": [], "shapes": [], "kinds": []})
        a["params"] += row.params * row.instances // share
        a["bytes"] += row.bytes * row.instances // share
        a["active"] += Fraction(row.active_decode_params) / share
        if len(row.shape) == 2 and row.box != "engram.embed":   # a table lookup is not a matmul
            a["matmul"] += Fraction(row.active_decode_params) / share
        fmt = row.fmt or row.dtype
        if fmt not in a["fmts"]:
            a["fmts"].append(fmt)
        per_layer = row.instances // share
        a["shapes"].append(("×".join(map(str, row.shape)) or "scalar") + (f" ×{per_layer}" if per_layer > 1 else ""))
        a["kinds"].append(row.box)
    return {box: BoxStat(params=a["params"], dtype="+".join(a["fmts"]), bytes=a["bytes"],
                         shapes=tuple(a["shapes"]), tensors=tuple(a["kinds"]), active_params=int(a["active"]),
                         matmul_params=int(a["matmul"]))
            for box, a in acc.items()}


def representative_layer(tab: str, plan, selected: int | None) -> int | None:
    """The layer a tab's figures describe: the selected one if the tab draws it, else its first layer."""
    if selected is not None and 0 <= selected < len(plan) and plan[selected].tab == tab and not plan[selected].is_dspark:
        return selected
    for r in plan:
        if r.tab == tab and not r.is_dspark:
            return r.layer
    return None


def tally_figure(lines: list[MarginLine], position: str, *, highlight: str | None = None,
                 accent: str = ROLE_COLOURS["full_m2"]) -> Figure:
    """One row per line, largest at the top: the line's name and figures on top, its bar below, both
    from the chart's left edge (names and figures beside the bars did not fit a narrow column: the
    largest label was cut, in the PNG too). Each row has a full-width pale stripe behind it so a
    click anywhere on the row picks it (customdata = ["box|box", line id])."""
    total = float(sum(float(l.value) for l in lines)) or 1.0
    top = max((float(l.value) for l in lines), default=1.0) or 1.0
    titles = [l.title for l in lines]
    data = [["|".join(l.boxes), l.id] for l in lines]
    hover = [f"<b>{l.title}</b><br>{fmt_params(l.value)} parameters ({float(l.value) / total:.2%})<br>{l.note}"
             + ("<br><i>click: highlight these boxes</i>" if l.boxes else "") for l in lines]
    fig = Figure()
    fig.add_trace(dict(type="bar", y=titles, x=[top * 1.02] * len(lines), orientation="h", customdata=data,
                       hovertext=hover, hoverinfo="text", marker=dict(color=GRID, opacity=0.35, line=dict(width=0)),
                       width=0.94, name="rows"))
    colours = [HIGHLIGHT if l.id == highlight else (accent if l.boxes else MUTED) for l in lines]
    fig.add_trace(dict(type="bar", y=titles, x=[float(l.value) for l in lines], orientation="h", customdata=data,
                       hovertext=hover, hoverinfo="text", marker=dict(color=colours, line=dict(width=0)),
                       width=0.34, offset=0.08, name="values"))
    fig.add_trace(dict(type="scatter", mode="text", y=titles, x=[0] * len(lines), hoverinfo="skip", name="labels",
                       text=[f"{l.title} · <b>{fmt_params(l.value)}</b> · {float(l.value) / total:.1%}" for l in lines],
                       textposition="top right", cliponaxis=False, textfont=dict(size=10, color=INK)))
    fig.update_layout(**base_layout(
        height=20 + 34 * len(lines), barmode="overlay", margin=dict(l=4, r=4, t=8, b=4),
        xaxis=dict(range=[0, top * 1.02], visible=False, fixedrange=True),
        yaxis=dict(autorange="reversed", fixedrange=True, showticklabels=False),
        clickmode="event", hovermode="closest",
    ))
    return fig


def headline(tally: Tally, position: str) -> str:
    """The number above the bars, e.g. 'Total: 763.2B parameters'."""
    return f"{POSITION_TITLES[position]}: {fmt_params(position_total(tally, position))} parameters"


def source_note(tally: Tally) -> str:
    if tally.source == "config":
        return "Figures from the config (the tensor contract it implies), not from a checkpoint."
    return f"Figures from the {tally.source} (no tensor data read)."
