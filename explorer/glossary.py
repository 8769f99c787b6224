"""Words the page uses, explained once: the CSA2 glossary, one caption per view, and the names and
titles exported charts and files carry (model, layer, query, prompt hash), so a PNG or CSV found in a
folder later still says what it shows."""

from __future__ import annotations

import hashlib
import re

from .figure import Figure
from .style import MUTED

# term -> one or two plain sentences; the page's expander lists them in this order
GLOSSARY: dict[str, str] = {
    "CSA2": "The attention of V4.1: every layer attends over its own sliding window of recent tokens, and most "
            "layers add a few hundred entries picked from a compressed copy of the whole prompt.",
    "window": "The last `window_size` tokens (128 in the release) that every layer attends to in full, stored in FP8.",
    "global entry": "One slot of the compressed KV: it stands for m consecutive prompt tokens (entry j covers "
                    "tokens j·m … j·m+m−1).",
    "m (compress ratio)": "How many tokens one global entry pools: m=2 in layers 2-19 (gated 2-to-1 pooling), "
                          "m=1 in layers 20-39 (one entry per token), 0 for window-only layers.",
    "SWA-only": "A layer with only its sliding window: no global entries, no selections (layers 0 and 1).",
    "Full": "A layer that builds the compressed KV (its compressor), the index keys and its own top-k, and "
            "publishes them to the layers above (layers 2, 8, 14, 20).",
    "Reindex": "A layer with its own indexer queries: it scores the latest Full layer's index keys and picks its "
               "own top-k, inside layer 20's candidate pool (layers 24, 28, 32, 36).",
    "Reuse": "A layer that computes no selection: it attends over the latest Full layer's KV with the top-k the "
             "latest Full or Reindex layer picked.",
    "compressor": "The Full layer's pooling of m tokens into one entry (a softmax gate per channel when m=2).",
    "indexer": "A small scorer (its own heads and FP4 keys) that rates every visible global entry for a query; "
               "the top-k by its score are the entries attention reads.",
    "index score": "The indexer's rating of one entry for one query: per index head a ReLU'd dot product, "
                   "weighted per head and summed. No unit; only the order matters.",
    "top-k": "The k entries (512 in the release, 64 in the live model) with the best index scores. Ties at "
             "the k-th score: `reference` numerics (the default) takes torch.topk over the whole row, as the "
             "official reference does, so which tied entry wins is not a rule of position; `fp32` numerics gives "
             "them to the earlier position.",
    "tie": "A pick whose index score equals an unpicked entry's (often exactly 0 after the ReLU): the indexer "
           "could not tell them apart, and the tie rule of the run's numerics chose (see top-k). Tied picks "
           "are marked in the score chart.",
    "zero-score pick": "A selected entry whose index score is exactly 0: chosen by the tie rule, not by the indexer.",
    "runner-up": "One of the best entries the indexer did not pick, with its score: how close the k-th pick came.",
    "selection recall": "The share of the attention mass the layer would put on its picks if it attended to "
                        "every visible global entry (softmax over those entries, averaged over heads): 1 means "
                        "the picks hold all the mass full attention would give them.",
    "candidate pool": "Layer 20 keeps, per query, the best 2,048 blocks of 8 entries; the Reindex layers above "
                      "it pick only inside that pool.",
    "attention sink": "A learned per-head logit added to the softmax's denominator: a head can attend to "
                      "nothing.",
    "mHC": "Manifold-constrained hyper-connections: the residual stream is kept as 4 copies, and each sub-layer "
           "reads a mix of them and writes back into all of them.",
    "pre (collapse)": "The weights that collapse the 4 residual copies into the one input of a sub-layer.",
    "post (write back)": "The weights with which a sub-layer's output is added back to each copy.",
    "comb": "The 4×4 mix of the copies themselves between sub-layers (a doubly stochastic matrix: Sinkhorn "
            "rounds); row i → column j is how much of copy i flows into copy j.",
    "routed expert": "One of the MoE's experts (384 in the release); each token runs on 6 of them.",
    "shared expert": "The expert every token runs on, beside its routed ones.",
    "gate score": "The router's score of an expert for a token (sqrt-softplus of a dot product); the chosen "
                  "experts' weights are these scores, normalized.",
    "balance bias": "A per-expert bias added to the gate scores only to pick the experts (bias for text, "
                    "bias_vl for image tokens); it keeps the experts' load even and does not change weights.",
    "Engram": "Hashed n-gram embedding tables read before layers 1 and 14: memory looked up by the last few tokens.",
    "DSpark": "The 3 draft stages after layer 39 that propose the next tokens for speculative decoding; counted "
              "here, not run.",
    "FP8 / FP4": "Storage formats: E4M3 8-bit floats with an E8M0 (power-of-two) scale per 32 values; E2M1 "
                 "4-bit floats with a scale per 16 or 32.",
}

CAPTIONS: dict[str, str] = {
    "topk_map": "Each row is a query position, each column a global entry: a dark cell is an entry that query "
                "selected (binned cells are shaded by the share selected); the light band is the candidate pool "
                "and the dotted lines the sliding window's edges. Click a row to make it the query.",
    "scores": "Scores behind the selected query's picks: each bar is one entry, ranked by index score.",
    "prompt_scores": "Across the prompt: how many of each query's picks scored exactly 0 (left axis) and, once "
                     "scored, the selection recall (right axis, 0-1).",
    "token_strip": "The prompt as tokens: the shade is how many queries selected a token's entry; ringed tokens "
                   "are the entries the selected query picked. Click a token to make it the query.",
    "mhc_token": "One token's mHC weights: pre (how the 4 copies collapse into the sub-layer's input), post (how "
                 "its output is written back), and the two 4×4 comb mixes (colour: weight 0-1).",
    "mhc_lines": "Left: pre (solid) and post (dotted) weight of each residual copy across the prompt. Right: the "
                 "norm of each copy after the layer.",
    "routing_map": "Left: routing weight of each token (row) on each routed expert (column), 0 where not chosen. "
                   "Right: tokens per expert (text and image tokens stacked).",
    "routing_margin": "The gate scores behind one token's choice of experts.",
    "kv": "Bytes of cache by context length: global KV and index keys grow with the prompt, windows stay fixed.",
    "tally": "Parameters by kind of tensor; the bars sum to the total shown.",
}


def glossary_markdown(terms: list[str] | None = None) -> str:
    """The glossary as a markdown list (all terms, or these, in the glossary's order)."""
    keep = [t for t in GLOSSARY if terms is None or t in terms]
    return "\n".join(f"- **{t}**: {GLOSSARY[t]}" for t in keep)


def prompt_hash(text: str) -> str:
    """A short, stable name for a prompt (8 hex digits of its SHA-256)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "model"


def export_name(what: str, *, model: str, layer: int | None = None, query: int | None = None,
                prompt: str | None = None) -> str:
    """A file name (no extension) that says what it holds: `v41-flash-live_layer24_q120_p3fa2c1d0_topk`."""
    parts = [_slug(model)]
    if layer is not None:
        parts.append(f"layer{layer}")
    if query is not None:
        parts.append(f"q{query}")
    if prompt is not None:
        parts.append(f"p{prompt_hash(prompt)}")
    parts.append(_slug(what))
    return "_".join(parts)


def export_title(what: str, *, model: str, layer: int | None = None, query: int | None = None,
                 prompt: str | None = None) -> str:
    """The title an exported chart carries: `Layer 24 · top-k selections · query 120 · <model> · prompt 3fa2c1d0`."""
    parts = [f"Layer {layer}"] if layer is not None else []
    parts.append(what)
    if query is not None:
        parts.append(f"query {query}")
    parts.append(model)
    if prompt is not None:
        parts.append(f"prompt {prompt_hash(prompt)}")
    return " · ".join(parts)


def titled(fig: Figure, title: str, room: int = 22) -> Figure:
    """The figure with a small title on top (it travels into the PNG export): the top margin and the
    height grow by `room` pixels, so the plot area and a legend above it keep their places."""
    margin = dict(fig.layout.get("margin") or {})
    margin["t"] = int(margin.get("t") or 0) + room
    layout = dict(title=dict(text=title, x=0, xanchor="left", xref="paper", y=1, yanchor="top", yref="container",
                             pad=dict(t=4), font=dict(size=11, color=MUTED)), margin=margin)
    if fig.layout.get("height"):
        layout["height"] = int(fig.layout["height"]) + room
    fig.update_layout(**layout)
    return fig
