"""The block diagram, one drawing per role tab: the kernels a layer actually runs, bottom to top.

Boxes are data (`Box`), laid out per tab by `diagram_boxes`; `diagram_figure` draws them as shapes
plus a row of near-invisible square markers per box, so every box hovers and clicks (customdata =
[box id, anchor]). Parameter counts and dtypes come from the tally (`BoxStat`), never from here.
"""

from __future__ import annotations

from dataclasses import dataclass


from engine.config import ModelConfig
from engine.roles import TABS, LayerRole

from .figure import Figure
from .style import ENGRAM_COLOUR, HIGHLIGHT, INK, MHC_COLOUR, MUTED, ROLE_COLOURS, base_layout, fmt_bytes, fmt_params

# Live-view anchors a box can scroll to.
ANCHOR_TOPK, ANCHOR_MHC, ANCHOR_ROUTING = "topk", "mhc", "routing"


@dataclass(frozen=True)
class Box:
    id: str                  # the tally's box id (tally_view.BOX_KINDS key) or a weightless op
    label: str
    x0: float
    x1: float
    y0: float
    y1: float
    kind: str = "op"         # weight | op | cache | borrowed | mhc | norm
    note: str = ""           # what the box does, for the hover
    anchor: str | None = None

    @property
    def cx(self) -> float:
        return (self.x0 + self.x1) / 2

    @property
    def cy(self) -> float:
        return (self.y0 + self.y1) / 2


@dataclass(frozen=True)
class BoxStat:
    """What the tally says about one box for one layer."""
    params: int
    dtype: str
    bytes: int
    shapes: tuple[str, ...]
    tensors: tuple[str, ...]
    active_params: int       # touched per token (routed experts: the top-k share)
    matmul_params: int = 0   # the active share that sits in matrices (norms, biases, lookups excluded)

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds of the box's matmuls per token, as 2 x active matrix parameters."""
        return 2 * self.matmul_params


CLICK_ANCHORS = {"indexer_wq_b": ANCHOR_TOPK, "indexer_weights_proj": ANCHOR_TOPK, "indexer_wk": ANCHOR_TOPK,
                 "indexer_k_norm": ANCHOR_TOPK, "indexer_score": ANCHOR_TOPK, "topk_select": ANCHOR_TOPK,
                 "borrowed_topk": ANCHOR_TOPK, "hc_attn": ANCHOR_MHC, "hc_attn_post": ANCHOR_MHC,
                 "hc_ffn": ANCHOR_MHC, "hc_ffn_post": ANCHOR_MHC, "gate": ANCHOR_ROUTING,
                 "experts": ANCHOR_ROUTING, "shared_experts": ANCHOR_ROUTING}

# Column x-ranges of the attention half (0..100 wide).
_Q, _KV, _CMP, _IDX = (9, 27), (29, 47), (50, 70), (73, 95)
H_TOTAL = 100.0


def _b(id: str, label: str, x: tuple[float, float], y: float, kind: str = "op", note: str = "",
       h: float = 4.2) -> Box:
    return Box(id, label, x[0], x[1], y, y + h, kind, note, CLICK_ANCHORS.get(id))


def diagram_boxes(cfg: ModelConfig, tab: str, role: LayerRole | None = None) -> list[Box]:
    """The boxes of one tab. `role` (the selected layer, when it is drawn by this tab) names the
    borrowed sources and adds the Engram box where the layer has one."""
    if tab not in TABS:
        raise ValueError(f"unknown diagram tab {tab!r}; expected one of {', '.join(TABS)}")
    mine = role if role is not None and role.tab == tab else None
    boxes: list[Box] = []
    add = boxes.append
    if mine is not None and mine.engram:
        add(_b("engram", "Engram n-gram lookup (adds gate·value to each copy)", (9, 95), -7, "weight",
               f"hashed 2-,3-,4-grams, {cfg.engram_n_heads} heads each → {cfg.engram_head_dim}-wide rows → wkv "
               "→ keys and a shared value; gated per residual copy"))

    # attention sub-layer
    add(_b("hc_attn", "mHC pre-mix · collapse 4 copies → 1", (9, 95), 0, "mhc",
           f"24 coefficients per token from the flattened {cfg.hc_mult}×{cfg.dim} stream; the collapse uses "
           "the previous sub-layer's pre weights (single pass)", h=3.6))
    add(_b("attn_norm", "attn_norm", (38, 66), 5.4, "norm", "RMSNorm over dim"))
    add(_b("wq_a", "wq_a", _Q, 11.5, "weight", f"{cfg.dim} → {cfg.q_lora_rank} (low-rank query)"))
    add(_b("q_norm", "q_norm", _Q, 17.2, "norm", "RMSNorm of the query latent"))
    add(_b("wq_b", "wq_b", _Q, 22.9, "weight", f"{cfg.q_lora_rank} → {cfg.n_heads}×{cfg.head_dim} heads"))
    add(_b("q_rope", f"RoPE (last {cfg.rope_head_dim})", _Q, 28.6, "op",
           "interleaved-pair rotation of the last rope dims" + (", YaRN" if tab != "swa" else ", theta 10000")))
    add(_b("wkv", "wkv", _KV, 11.5, "weight", f"{cfg.dim} → {cfg.head_dim}: the one KV latent (K = V)"))
    add(_b("kv_norm", "kv_norm", _KV, 17.2, "norm", "RMSNorm of the latent"))
    add(_b("kv_rope", f"RoPE (last {cfg.rope_head_dim})", _KV, 22.9, "op", "rotated once, stored rotated"))
    add(_b("window", f"FP8 window ({cfg.window_size})", _KV, 28.6, "cache",
           f"{cfg.window_size} entries × ({cfg.head_dim} E4M3 + {cfg.head_dim // 32} E8M0) bytes, bounded"))

    if tab in ("full_m2", "full_m1"):
        m = 2 if tab == "full_m2" else 1
        if m == 2:
            add(_b("compressor_wkv", "cmp.wkv", (_CMP[0], 59.6), 11.5, "weight", f"{cfg.dim} → {cfg.head_dim}"))
            add(_b("compressor_wgate", "cmp.wgate", (60.4, _CMP[1]), 11.5, "weight",
                   f"{cfg.dim} → {cfg.head_dim} gate scores"))
            add(_b("compressor_pool", "gated 2→1 pool", _CMP, 17.2, "op",
                   "softmax over the 2 tokens of a pair, per channel"))
        else:
            add(_b("compressor_wkv", "cmp.wkv", _CMP, 11.5, "weight", f"{cfg.dim} → {cfg.head_dim} (no gate, m=1)"))
            add(_b("compressor_pool", "one entry per token", _CMP, 17.2, "op", "m=1: no pooling"))
        add(_b("compressor_norm", "cmp.norm → RoPE", _CMP, 22.9, "norm", "rotated at the group's first position"))
        add(_b("global_kv", f"FP4 KV · 1/{m} per token", _CMP, 28.6, "cache",
               "512 E2M1 + one E4M3 scale per 16 = 288 B per entry; read by the layers above"))
        add(_b("indexer_wk", "idx.wk", (_IDX[0], 83.6), 11.5, "weight",
               f"{cfg.head_dim} → {cfg.index_head_dim} index key from the pre-RoPE latent"))
        add(_b("indexer_k_norm", "k_norm", (84.4, _IDX[1]), 11.5, "norm", "index key RMSNorm"))
        add(_b("index_keys", "FP4 index keys", _IDX, 17.2, "cache", "128 E2M1 + E8M0 per 32 = 68 B per entry"))
    else:
        src = mine.kv_source if mine is not None else None
        if tab == "swa":
            add(_b("no_global", "no global branch", (_CMP[0], _IDX[1]), 17.2, "borrowed",
                   "window-only layer: attends over its sliding window alone", h=15.6))
        else:
            add(_b("borrowed_kv", f"KV cache of layer {src}" if src is not None else "KV of the latest Full layer",
                   _CMP, 28.6, "borrowed", "compressed KV borrowed from the latest KV source below"))
    if tab in ("full_m2", "full_m1", "reindex"):
        add(_b("indexer_wq_b", "idx.wq_b", (_IDX[0], 83.6), 22.9, "weight",
               f"query latent → {cfg.index_n_heads}×{cfg.index_head_dim} index queries (FP4)"))
        add(_b("indexer_weights_proj", "w_proj", (84.4, _IDX[1]), 22.9, "weight",
               f"{cfg.dim} → {cfg.index_n_heads} per-head weights"))
        pool = ""
        if mine is not None and mine.in_candidate_pool or (mine is None and tab == "reindex"):
            pool = " in pool"
        add(_b("topk_select", f"top-{cfg.index_topk}{pool}", _IDX, 28.6, "op",
               "lightning indexer: score = Σ_h w_h·relu(q_h·k); top-k kept in position order"
               + ("; scored only inside the candidate pool" if pool else "")))
        if tab == "reindex":
            key_src = mine.index_key_source if mine is not None else None
            add(_b("borrowed_keys", f"index keys of layer {key_src}" if key_src is not None else "borrowed index keys",
                   _IDX, 17.2, "borrowed", "index keys borrowed from the KV source"))
    elif tab == "reuse":
        src = mine.index_source if mine is not None else None
        add(_b("borrowed_topk", f"top-k of layer {src}" if src is not None else "borrowed top-k",
               _IDX, 28.6, "borrowed", "selection borrowed from the latest index source below"))

    add(_b("attn_core", "sparse attention · 1 KV head · sinks", (9, 80), 35.2, "op",
           f"{cfg.n_heads} heads over window" + ("" if tab == "swa" else f" + top-{cfg.index_topk} global entries")
           + f"; scale {cfg.head_dim}^-0.5; exp(sink) in the denominator"))
    add(_b("attn_sink", "sink", (81, 95), 35.2, "weight", f"{cfg.n_heads} per-head logits"))
    add(_b("o_rope", "inverse RoPE", (9, 30), 41.0, "op", "the output's rope dims rotated back"))
    add(_b("wo_a", f"wo_a · {cfg.o_groups} groups", (32, 63), 41.0, "weight",
           f"{cfg.o_groups} × ({cfg.n_heads // cfg.o_groups * cfg.head_dim} → {cfg.o_lora_rank}), run in bf16"))
    add(_b("wo_b", "wo_b", (65, 95), 41.0, "weight", f"{cfg.o_groups * cfg.o_lora_rank} → {cfg.dim}"))
    add(_b("hc_attn_post", "mHC post-mix · post 4 + comb 4×4 (Sinkhorn)", (9, 95), 46.8, "mhc",
           "writes back: post[j]·attn + Σ comb[i,j]·X[i]", h=3.6))

    # FFN sub-layer
    add(_b("hc_ffn", "mHC pre-mix · collapse 4 → 1", (9, 95), 53.0, "mhc",
           "the attention sub-layer's pre weights collapse the FFN input", h=3.6))
    add(_b("ffn_norm", "ffn_norm", (38, 66), 58.4, "norm", "RMSNorm over dim"))
    add(_b("gate", "gate (bias, bias_vl)", (9, 44), 64.5, "weight",
           f"√softplus scores, top-{cfg.n_activated_experts} of {cfg.n_routed_experts} with bias "
           "(bias_vl on image positions)"))
    add(_b("experts", f"routed experts · {cfg.n_activated_experts} of {cfg.n_routed_experts}", (9, 62), 70.5,
           "weight", f"SwiGLU {cfg.dim} → {cfg.moe_inter_dim} → {cfg.dim}, clamped at {cfg.swiglu_limit:g}; "
           f"weights × {cfg.route_scale:g}", h=5.0))
    add(_b("shared_experts", "shared expert", (64, 95), 70.5, "weight",
           f"always on: {cfg.dim} → {cfg.moe_inter_dim} → {cfg.dim}", h=5.0))
    add(_b("hc_ffn_post", "mHC post-mix · post 4 + comb 4×4", (9, 95), 77.6, "mhc",
           "writes back: post[j]·moe + Σ comb[i,j]·X[i]; its pre weights go to the next block", h=3.6))
    return boxes


def _arrows(boxes: list[Box]) -> list[tuple[str, str]]:
    """Data flow between the boxes present in this tab (from, to): consecutive present links of each chain."""
    ids = {b.id for b in boxes}
    chains = [
        ["engram", "hc_attn", "attn_norm"],
        ["wq_a", "q_norm", "wq_b", "q_rope", "attn_core"],
        ["wkv", "kv_norm", "kv_rope", "window", "attn_core"],
        ["compressor_wkv", "compressor_pool", "compressor_norm", "global_kv", "attn_core"],
        ["compressor_wgate", "compressor_pool"],
        ["indexer_wk", "index_keys", "topk_select"],
        ["indexer_k_norm", "index_keys"],
        ["borrowed_keys", "topk_select"],
        ["indexer_wq_b", "topk_select", "attn_core"],
        ["indexer_weights_proj", "topk_select"],
        ["borrowed_kv", "attn_core"], ["borrowed_topk", "attn_core"],
        ["attn_core", "o_rope", "wo_a", "wo_b", "hc_attn_post"],
        ["hc_attn_post", "hc_ffn", "ffn_norm", "gate", "experts", "hc_ffn_post"],
        ["ffn_norm", "shared_experts", "hc_ffn_post"],
    ]
    out: list[tuple[str, str]] = []
    for chain in chains:
        present = [c for c in chain if c in ids]
        for link in zip(present, present[1:]):
            if link not in out:
                out.append(link)
    return out


_FILL = {"weight": "#FFFFFF", "op": "#F3F4F6", "cache": "#FFF8E1", "borrowed": "#FFFFFF", "norm": "#F9FAFB",
         "mhc": "#EFEAF8"}


# the diagram is ~560 px wide at its narrowest (a 1600 px window with the sidebar open): ~5.8 px per x
# unit; a glyph of this font averages ~0.62 of its size (bold)
PX_PER_UNIT, GLYPH_EM, LABEL_SIZE, MIN_LABEL_SIZE = 5.8, 0.62, 11, 8


def _label_lines(box: Box, stat: BoxStat | None) -> tuple[str, str | None]:
    """(bold name, grey figures or None): the dtype is left to the hover where it would not fit."""
    if stat is None:
        return box.label, "(no tally)" if box.kind == "weight" else None
    fits = (box.x1 - box.x0) * PX_PER_UNIT / (GLYPH_EM * LABEL_SIZE)
    paren = f"({fmt_params(stat.params)} {stat.dtype})"
    return box.label, paren if len(paren) <= fits else f"({fmt_params(stat.params)})"


def _box_text(box: Box, stat: BoxStat | None) -> tuple[str, int]:
    """The box's label (HTML) and its font size: on one line if it fits, else figures on a second
    line; the size shrinks (to MIN_LABEL_SIZE) until the longest line fits inside the box."""
    grey = "#8A8F98"
    name, paren = _label_lines(box, stat)
    room = (box.x1 - box.x0) * PX_PER_UNIT - 4
    one_line = len(name) + (len(paren) + 1 if paren else 0)
    wrap = paren is not None and one_line * GLYPH_EM * LABEL_SIZE > room
    longest = max(len(name), len(paren or "")) if wrap else one_line
    size = max(MIN_LABEL_SIZE, min(LABEL_SIZE, int(room / (GLYPH_EM * max(longest, 1)))))
    bold = box.kind not in ("op", "cache", "borrowed") or paren is not None
    text = f"<b>{name}</b>" if bold else name
    if paren:
        text += ("<br>" if wrap else " ") + f"<span style='color:{grey}'>{paren}</span>"
    return text, size


def _box_hover(box: Box, stat: BoxStat | None) -> str:
    lines = [f"<b>{box.label}</b>"]
    if box.note:
        lines.append(box.note)
    if stat is not None:
        lines.append(f"params {stat.params:,} · {stat.dtype} · {fmt_bytes(stat.bytes)}")
        if stat.shapes:
            lines.append("shapes: " + ", ".join(stat.shapes[:4]) + (" …" if len(stat.shapes) > 4 else ""))
        if stat.matmul_params:
            lines.append(f"FLOPs per token ≈ {fmt_params(stat.flops_per_token)} "
                         f"(2 × {fmt_params(stat.matmul_params)} active matrix params)")
        elif stat.active_params:
            lines.append(f"touched per token: {fmt_params(stat.active_params)} params (no matmul)")
    if box.anchor:
        lines.append(f"<i>click: jump to the live {box.anchor} view</i>")
    return "<br>".join(lines)


def diagram_figure(cfg: ModelConfig, tab: str, stats: dict[str, BoxStat] | None = None, *,
                   role: LayerRole | None = None, highlight: set[str] | frozenset = frozenset(),
                   height: int = 760) -> Figure:
    """Draw one tab. `stats` maps box id -> BoxStat (from the tally); `highlight` outlines boxes
    (picked in the tally margin)."""
    stats = stats or {}
    boxes = diagram_boxes(cfg, tab, role)
    accent = ROLE_COLOURS[tab]
    by_id = {b.id: b for b in boxes}
    fig = Figure()
    shapes: list[dict] = []
    notes: list[dict] = []
    y_min = min(b.y0 for b in boxes) - 1.5

    # the residual stream: hc_mult thin lanes on the left
    for i in range(cfg.hc_mult):
        x = 1.6 + i * 1.3
        shapes.append(dict(type="line", x0=x, x1=x, y0=y_min + 0.5, y1=H_TOTAL - 18.5,
                           line=dict(color=MHC_COLOUR, width=1.4), opacity=0.55, layer="below"))
    notes.append(dict(x=3.5, y=H_TOTAL - 18.2, text=f"X ×{cfg.hc_mult}", showarrow=False,
                      font=dict(size=10, color=MHC_COLOUR), yanchor="bottom"))
    # sub-layer enclosures
    for name, y0, y1, colour in (("attention", -1.2, 50.9, accent), ("MoE", 52.0, 81.7, "#9CA3AF")):
        shapes.append(dict(type="rect", x0=8, x1=96.2, y0=y0, y1=y1, line=dict(color=colour, width=1.2, dash="dot"),
                           fillcolor="rgba(0,0,0,0)", layer="below"))
        notes.append(dict(x=96.2, y=y1, text=name, showarrow=False, xanchor="right", yanchor="bottom",
                          font=dict(size=10, color=colour)))

    # Arrows and box labels are two traces, not ~55 annotations: the browser draws a trace of
    # segments or texts in a few ms, and an annotation each in ~2 ms (the diagram redraws per click).
    arrow_x: list = []
    arrow_y: list = []
    for a, b in _arrows(boxes):
        src, dst = by_id[a], by_id[b]
        lo, hi = max(src.x0, dst.x0), min(src.x1, dst.x1)
        if abs(src.y0 - dst.y0) < 1:    # same row: a short horizontal arrow
            left = src.x1 < dst.x0
            start, end = (src.x1 if left else src.x0, src.cy), (dst.x0 if left else dst.x1, dst.cy)
        elif hi - lo > 2:     # overlapping columns: a straight vertical arrow
            start, end = ((lo + hi) / 2, src.y1), ((lo + hi) / 2, dst.y0)
        else:
            start, end = (src.cx, src.y1), (min(max(src.cx, dst.x0 + 3), dst.x1 - 3), dst.y0)
        arrow_x += [start[0], end[0], None]
        arrow_y += [start[1], end[1], None]

    for box in boxes:
        colour = MHC_COLOUR if box.kind == "mhc" else ENGRAM_COLOUR if box.id == "engram" else accent
        hot = box.id in highlight or (box.id.endswith("_post") and box.id[:-5] in highlight)
        shapes.append(dict(type="rect", x0=box.x0, x1=box.x1, y0=box.y0, y1=box.y1, layer="below",
                           fillcolor=HIGHLIGHT if hot else _FILL.get(box.kind, "#FFFFFF"),
                           line=dict(color=INK if hot else colour, width=2.4 if hot else (1.4 if box.kind == "weight" else 1),
                                     dash="dash" if box.kind == "borrowed" else "solid")))

    # arrow shafts with a head on each segment's end (marker "arrow" turned along the segment)
    fig.add_trace(dict(type="scatter", x=arrow_x, y=arrow_y, mode="lines+markers", hoverinfo="skip",
                       line=dict(color="#B8BEC8", width=1), name="arrows",
                       marker=dict(symbol="arrow", angleref="previous", color="#B8BEC8",
                                   size=[0, 8, 0] * (len(arrow_x) // 3))))
    label_stats = [stats.get(b.id) or (stats.get(b.id[:-5]) if b.id.endswith("_post") else None) for b in boxes]
    labels = [_box_text(b, stat) for b, stat in zip(boxes, label_stats)]
    fig.add_trace(dict(type="scatter", mode="text", hoverinfo="skip", name="labels",
                       x=[b.cx for b in boxes], y=[b.cy for b in boxes], text=[t for t, _ in labels],
                       textfont=dict(size=[size for _, size in labels],
                                     color=[MUTED if b.kind == "borrowed" else INK for b in boxes])))

    # hover and click targets: a row of faint squares across each box
    xs, ys, data, hover = [], [], [], []
    for box in boxes:
        stat = stats.get(box.id) or (stats.get(box.id[:-5]) if box.id.endswith("_post") else None)
        n = max(1, int((box.x1 - box.x0) // 4))
        for i in range(n):
            xs.append(box.x0 + (i + 0.5) * (box.x1 - box.x0) / n)
            ys.append(box.cy)
            data.append([box.id, box.anchor or ""])
            hover.append(_box_hover(box, stat))
    fig.add_trace(dict(type="scatter", x=xs, y=ys, mode="markers", customdata=data, hovertext=hover,
                       hoverinfo="text", marker=dict(symbol="square", size=22, color="rgba(255,255,255,0.01)"),
                       name="boxes"))
    fig.update_layout(**base_layout(
        shapes=shapes, annotations=notes,
        height=height, margin=dict(l=4, r=4, t=4, b=4),
        xaxis=dict(range=[0, 97], visible=False, fixedrange=True),
        yaxis=dict(range=[y_min, 84.2], visible=False, fixedrange=True),
        clickmode="event", hovermode="closest",
    ))
    return fig
