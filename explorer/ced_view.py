"""Serving prefill in the explorer: what a decoder layer does at the generated tokens when the prompt
was prefilled the reference's way (every layer over every prompt token) or the serving way (a CED
prefill, engine/ced.py: the decoder over only the last R prompt tokens).

Inputs are run JSONs (`RunResult.to_json()`): the full run with `generated_probes`, and the CED run
teacher-forced on the full run's generated tokens (`continuation`), so both views are of the same
tokens; the CED run's own greedy picks say where its continuation would have parted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .figure import Figure
from .style import GRID, INK, MUTED, ROLE_COLOURS, base_layout

FULL_COLOUR = "#0072B2"            # blue: the reference's prefill
CED_COLOUR = ROLE_COLOURS["full_m1"]  # vermillion: the decoder's own prefill


def decoder_note(layer: int, split: int, window: int) -> str | None:
    """The caption a decoder layer's live view carries (None for encoder layers)."""
    if layer < split:
        return None
    return (f"In serving, layer {layer} does not run on prompt tokens. A CED prefill runs layers 0-{split - 1} "
            f"and layer {split}'s KV and index-key projection over the prompt, and the decoder (layers "
            f"{split} up) over only the last R prompt tokens (default {window}, the window), whose windows "
            "fill from that replay. What is shown here for prompt positions is the teacher-forced view "
            "(every layer over every prompt token, as the reference prefills); the serving-prefill switch "
            "compares the generated tokens' views under both prefills.")


def jaccard_rows(a, b) -> np.ndarray:
    """Per row, |A & B| / |A | B| of the entry sets (-1 is padding); two empty rows agree (1.0).
    a, b: [G, k] -> [G]."""
    a, b = np.asarray(a), np.asarray(b)
    out = np.ones(a.shape[0])
    for g in range(a.shape[0]):
        sa, sb = set(a[g][a[g] >= 0].tolist()), set(b[g][b[g] >= 0].tolist())
        if sa or sb:
            out[g] = len(sa & sb) / len(sa | sb)
    return out


def overlap_rows(a, b) -> np.ndarray:
    """Per row, the share of A's k routed experts that B also picked: [G, k], [G, k] -> [G]."""
    a, b = np.asarray(a), np.asarray(b)
    return np.array([len(set(x.tolist()) & set(y.tolist())) / max(1, len(x)) for x, y in zip(a, b)])


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first step where two token lists differ (the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass
class GeneratedComparison:
    """One layer at the generated tokens, under the full prefill and a CED prefill."""
    layer: int
    replay: int
    tokens: list[str]              # the fed (full run's) generated tokens, as text
    full_picks: list[int]          # the full run's greedy tokens
    ced_picks: list[int]           # the CED run's greedy pick at each step (teacher-forced)
    diverges_at: int               # first step where they differ (= steps: never)
    full_topk: np.ndarray | None   # [G, k] selected global entries (-1 padding)
    ced_topk: np.ndarray | None
    jaccard: np.ndarray | None     # [G]
    full_experts: np.ndarray       # [G, k] routed experts
    ced_experts: np.ndarray
    routing_agreement: np.ndarray  # [G]
    full_prefill_s: float
    ced_prefill_s: float

    @property
    def steps(self) -> int:
        return len(self.routing_agreement)

    def summary(self) -> dict:
        return {
            "layer": self.layer, "replay": self.replay, "steps": self.steps,
            "topk_jaccard": None if self.jaccard is None else float(self.jaccard.mean()),
            "routing_agreement": float(self.routing_agreement.mean()) if self.steps else None,
            "diverges_at": self.diverges_at,
            "full_prefill_s": self.full_prefill_s, "ced_prefill_s": self.ced_prefill_s,
            "time_ratio": self.ced_prefill_s / self.full_prefill_s if self.full_prefill_s > 0 else None,
        }


class ComparisonError(ValueError):
    """The two runs cannot be compared; the message says why."""


def compare(full: dict, ced: dict, layer: int, token_text=None) -> GeneratedComparison:
    """The generated tokens' views of `layer` in two run JSONs (full and ced, both with generated probes).
    token_text: ids -> strings for the fed tokens (default: the ids as text)."""
    if full.get("prefill", "full") != "full" or ced.get("prefill") != "ced":
        raise ComparisonError("compare needs a full-prefill run and a CED-prefill run")
    key = str(layer)
    gf, gc = full.get("generated_layers", {}).get(key), ced.get("generated_layers", {}).get(key)
    if gf is None or gc is None:
        raise ComparisonError(f"layer {layer} has no probes at the generated tokens in both runs "
                              "(run with generated_probes)")
    fed = list(full["generated_ids"])[: len(gc["routing"]["experts"])]
    steps = min(len(gf["routing"]["experts"]), len(gc["routing"]["experts"]))
    full_topk = ced_topk = jac = None
    if gf.get("topk") is not None and gc.get("topk") is not None:
        full_topk, ced_topk = _rows(gf["topk"][:steps]), _rows(gc["topk"][:steps])
        jac = jaccard_rows(full_topk, ced_topk)
    full_exp, ced_exp = np.asarray(gf["routing"]["experts"][:steps]), np.asarray(gc["routing"]["experts"][:steps])
    text = token_text(fed[:steps]) if token_text is not None else [str(i) for i in fed[:steps]]
    return GeneratedComparison(
        layer=layer, replay=int(ced["replay"]), tokens=list(text), full_picks=list(full["generated_ids"]),
        ced_picks=list(ced["generated_ids"]), diverges_at=first_divergence(full["generated_ids"], ced["generated_ids"]),
        full_topk=full_topk, ced_topk=ced_topk, jaccard=jac, full_experts=full_exp, ced_experts=ced_exp,
        routing_agreement=overlap_rows(full_exp, ced_exp), full_prefill_s=float(full.get("prefill_s", 0.0)),
        ced_prefill_s=float(ced.get("prefill_s", 0.0)))


def _rows(rows) -> np.ndarray:
    """Ragged or None-padded rows of entry ids as an int array [G, k], -1 padded."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for g, r in enumerate(rows):
        out[g, :len(r)] = [-1 if v is None else v for v in r]
    return out


def _marks(mine: np.ndarray, other: np.ndarray) -> tuple[list, list, list, list]:
    """(x, y) of the values each row shares with `other`, and of those only it has (padding skipped)."""
    sx, sy, ox, oy = [], [], [], []
    for g in range(mine.shape[0]):
        theirs = set(other[g].tolist())
        for v in mine[g].tolist():
            if v < 0:
                continue
            (sx if v in theirs else ox).append(g)
            (sy if v in theirs else oy).append(v)
    return sx, sy, ox, oy


def side_by_side_figure(cmp: GeneratedComparison, height: int = 520) -> Figure:
    """Selections (top) and routed experts (bottom) at each generated token, full prefill left, CED
    right; what the other side also picked is grey, what only this side picked is coloured."""
    fig = Figure(layout=base_layout(height=height, margin=dict(l=56, r=12, t=48, b=44)))
    panels = [("full", FULL_COLOUR, cmp.full_topk, cmp.ced_topk, cmp.full_experts, cmp.ced_experts, cmp.full_prefill_s),
              ("ced", CED_COLOUR, cmp.ced_topk, cmp.full_topk, cmp.ced_experts, cmp.full_experts, cmp.ced_prefill_s)]
    hover = "step %{x}<br>%{meta}: %{y}<extra></extra>"
    for col, (name, colour, topk, other_topk, experts, other_experts, seconds) in enumerate(panels):
        for row, (mine, other, what) in enumerate(((topk, other_topk, "entry"), (experts, other_experts, "expert"))):
            axis = 1 + col + 2 * row
            xa, ya = ("x", "y") if axis == 1 else (f"x{axis}", f"y{axis}")
            if mine is None:
                continue
            sx, sy, ox, oy = _marks(mine, other)
            fig.add_trace(dict(type="scatter", mode="markers", x=sx, y=sy, xaxis=xa, yaxis=ya, meta=what,
                               name="both", marker=dict(color=MUTED, size=5, opacity=0.5), hovertemplate=hover))
            fig.add_trace(dict(type="scatter", mode="markers", x=ox, y=oy, xaxis=xa, yaxis=ya, meta=what,
                               name=f"only {name}", marker=dict(color=colour, size=7, symbol="diamond"),
                               hovertemplate=hover))
        label = "full prefill (the reference)" if name == "full" else f"CED prefill, replay {cmp.replay}"
        fig.add_annotation(text=f"<b>{label}</b>: prefill {seconds:.2f} s", x=0.24 + 0.52 * col, y=1.0,
                           xref="paper", yref="paper", yanchor="bottom", showarrow=False, font=dict(color=colour))
    for axis in range(1, 5):
        col, row = (axis - 1) % 2, (axis - 1) // 2
        x_dom = [0.0, 0.48] if col == 0 else [0.52, 1.0]
        y_dom = [0.56, 1.0] if row == 0 else [0.0, 0.44]
        suffix = "" if axis == 1 else str(axis)
        fig.update_layout(**{
            f"xaxis{suffix}": dict(domain=x_dom, anchor=f"y{suffix}", gridcolor=GRID,
                                   title=dict(text="generated token" if row == 1 else "")),
            f"yaxis{suffix}": dict(domain=y_dom, anchor=f"x{suffix}", gridcolor=GRID,
                                   title=dict(text=("selected entry" if row == 0 else "routed expert") if col == 0 else ""),
                                   matches=None if col == 0 else ("y" if row == 0 else "y3")),
        })
    fig.update_layout(font=dict(color=INK))
    return fig


def agreement_figure(cmp: GeneratedComparison, height: int = 220) -> Figure:
    """Per generated token: top-k Jaccard and routing agreement (1 = the same picks), and where the CED
    run's own greedy continuation parts from the full run's."""
    steps = list(range(cmp.steps))
    fig = Figure(layout=base_layout(height=height, margin=dict(l=56, r=12, t=16, b=44), showlegend=True,
                                    legend=dict(orientation="h", y=1.1, x=0),
                                    xaxis=dict(title=dict(text="generated token")),
                                    yaxis=dict(range=[-0.02, 1.05], title=dict(text="agreement"))))
    if cmp.jaccard is not None:
        fig.add_trace(dict(type="scatter", mode="lines+markers", x=steps, y=cmp.jaccard.tolist(),
                           name="top-k Jaccard", line=dict(color=CED_COLOUR)))
    fig.add_trace(dict(type="scatter", mode="lines+markers", x=steps, y=cmp.routing_agreement.tolist(),
                       name="routing agreement", line=dict(color=FULL_COLOUR, dash="dot")))
    if cmp.diverges_at < cmp.steps:
        fig.add_vline(cmp.diverges_at, line=dict(color=MUTED, dash="dash"))
        fig.add_annotation(text="greedy continuations part", x=cmp.diverges_at, y=0.02, showarrow=False,
                           xanchor="left", font=dict(color=MUTED, size=11))
    return fig
