"""Why an entry was picked: the indexer's scores of one query's picks against the best unpicked
entries, ties marked, zero-score picks and selection recall across the prompt, and the same for the
MoE gate (the chosen experts against the next best).

Reads a layer's probes as `RunResult.to_json()` writes them (see explorer/layer_views.py), plus the
on-request fields `runner_ups` / `runner_up_scores` / `selection_recall` (engine run with
`detail_layers`), `zero_score_picks` and the tie probes `topk_kth` / `topk_tied` (engine/run/probes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .figure import Figure
from .style import GRID, INK, MUTED, base_layout

PICK = "#0072B2"       # a pick the indexer scored above every unpicked entry
TIED = "#E69F00"       # a pick whose score equals an unpicked entry's: the top-k's tie-break took it, not the score
RUNNER = "#A6A6A6"     # an entry that was not picked
KTH = "#D55E00"


OUTSIDE_POOL = -1e37   # at or below this: a pick from outside the candidate pool (-inf, None in JSON; float32 min
                       # in runs stored before the reference numerics)
OUTSIDE_LABEL = "outside the candidate pool (tied at -inf)"
OUTSIDE_UNTIED = "outside the candidate pool (score -inf)"   # the only visible entry left outside it: no tie
# engine/run/probes.py STORED_BEFORE_NUMERICS: a run JSON without "numerics" predates the field, when the
# engine computed only in float32 (not imported: the page draws without torch)
STORED_BEFORE_NUMERICS = "fp32"


class SelectionError(ValueError):
    """The probes do not hold what this view needs; the message says what."""


_NO_PROBE = object()   # QueryScores.probe_kth of a run stored before the tie probes


@dataclass
class QueryScores:
    """One query's picks (best first) and the best unpicked entries (best first)."""
    query: int
    picks: list[tuple[int, float]]            # (entry, index score; -inf: from outside the candidate pool)
    runners: list[tuple[int, float]] | None   # None: the run did not record runner-ups
    tied: list[bool]                          # per pick (in `picks` order)
    k: int = 0                                # the layer's index_topk (the probe's row width)
    probe_kth: object = _NO_PROBE             # the engine's topk_kth for this query (None: -inf in JSON)

    @property
    def outside(self) -> list[bool]:
        """Per pick: taken from outside the candidate pool (a Reindex layer whose pool held fewer
        than k visible entries; the reference's top-k takes such entries, all tied at -inf)."""
        return [s <= OUTSIDE_POOL for _, s in self.picks]

    @property
    def kth(self) -> float | None:
        """The k-th pick's score: the line an entry had to clear; -inf when the k-th pick came from
        outside the candidate pool, None when the query has fewer than k picks (no line).
        Read from the engine's `topk_kth` probe. Runs stored before that probe lack it: for them,
        the weakest shown pick's score (the same number for a full row; a row with fewer than k
        picks then shows its weakest pick's score as the line, as before the probe)."""
        if self.probe_kth is _NO_PROBE:
            return self.picks[-1][1] if self.picks else None
        if self.probe_kth is not None:
            return float(self.probe_kth)
        # JSON writes -inf as None: a full row's k-th pick is an outside-the-pool one, else the row is short
        return float("-inf") if self.picks and len(self.picks) >= self.k else None

    @property
    def best_unpicked(self) -> float | None:
        return self.runners[0][1] if self.runners else None

    @property
    def margin(self) -> float | None:
        """k-th pick's score minus the best unpicked one's (0: the last pick was a tie)."""
        kth = self.kth
        if kth is None or self.best_unpicked is None or kth <= OUTSIDE_POOL:
            return None
        return kth - self.best_unpicked

    @property
    def zero_picks(self) -> int:
        return sum(1 for _, s in self.picks if s == 0)


def _row(probe: dict, key: str, q: int):
    rows = probe.get(key)
    if rows is None:
        return None
    if not 0 <= q < len(rows):
        raise SelectionError(f"query {q} is outside the probe '{key}' (0..{len(rows) - 1})")
    return rows[q]


def query_scores(probe: dict, q: int) -> QueryScores:
    """The picks of query q with their scores, best first; ties with unpicked entries marked, every
    pick kept: one from outside the candidate pool (score -inf, None in JSON) scores -inf, last.

    A tie is a pick whose score equals the k-th while more entries share that score than were picked:
    which of them the top-k took is arbitrary (the engine's `topk_tied`). Runs without that probe: a
    pick is a tie when its score equals the best unpicked entry's, or is exactly 0 (the ReLU'd score
    of an entry the indexer gives nothing; many entries share it)."""
    entries, scores = _row(probe, "topk", q), _row(probe, "topk_scores", q)
    if entries is None or scores is None:
        raise SelectionError("the run recorded no top-k scores for this layer")
    marks = _row(probe, "topk_tied", q)
    # an entry (>= 0) whose score is None is a pick from outside the candidate pool (-inf); -1 is padding
    rows = sorted(((int(j), float("-inf") if s is None else float(s), None if marks is None else bool(marks[i]))
                   for i, (j, s) in enumerate(zip(entries, scores)) if j is not None and j >= 0),
                  key=lambda p: (-p[1], p[0]))
    runners = None
    r_entries, r_scores = _row(probe, "runner_ups", q), _row(probe, "runner_up_scores", q)
    if r_entries is not None and r_scores is not None:
        runners = [(int(j), float(s)) for j, s in zip(r_entries, r_scores)
                   if j is not None and j >= 0 and s is not None and s > OUTSIDE_POOL]
    best = runners[0][1] if runners else None
    tied = [t if t is not None else (s == 0 or (best is not None and s == best)) for _, s, t in rows]
    kths = probe.get("topk_kth")
    return QueryScores(q, [(j, s) for j, s, _ in rows], runners, tied, k=len(entries),
                       probe_kth=_NO_PROBE if kths is None else _row(probe, "topk_kth", q))


_MEMO: dict[tuple, tuple[tuple, object]] = {}   # per-prompt results, keyed by the probe lists they read


def _memo(name: str, sources: tuple, compute):
    """compute() once per set of probe lists: a rerun of the page (a click on a token) reads the same
    cached run, so the per-prompt counts are not rebuilt from 64 k Python numbers every time."""
    key = (name, *map(id, sources))
    hit = _MEMO.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], sources)):
        return hit[1]
    value = compute()
    if len(_MEMO) > 32:
        _MEMO.clear()
    _MEMO[key] = (sources, value)
    return value


def zero_score_counts(probe: dict) -> np.ndarray:
    """Per query: how many of its picks scored exactly 0 (the probe's own count, else from the scores)."""
    return _memo("zeros", (probe.get("zero_score_picks"), probe.get("topk"), probe.get("topk_scores")),
                 lambda: _zero_score_counts(probe))


def _zero_score_counts(probe: dict) -> np.ndarray:
    got = probe.get("zero_score_picks")
    if got is not None:
        return np.asarray(got, dtype=np.int32)
    entries, scores = probe.get("topk"), probe.get("topk_scores")
    if entries is None or scores is None:
        raise SelectionError("the run recorded no top-k scores for this layer")
    e = np.asarray(entries, dtype=np.int64)
    s = np.asarray([[np.nan if v is None else v for v in row] for row in scores], dtype=np.float64)
    return ((s == 0) & (e >= 0)).sum(-1).astype(np.int32)


def selection_summary(probe: dict) -> dict:
    """Over the prompt: picks, zero-score picks and their share, mean recall where recorded."""
    return _memo("summary", (probe.get("zero_score_picks"), probe.get("topk"), probe.get("topk_scores"),
                             probe.get("selection_recall")), lambda: _selection_summary(probe))


def _selection_summary(probe: dict) -> dict:
    zeros = zero_score_counts(probe)
    picks = int((np.asarray(probe.get("topk"), dtype=np.int64) >= 0).sum()) if probe.get("topk") is not None else 0
    recall = recall_series(probe)
    finite = recall[np.isfinite(recall)] if recall is not None else None
    return {"picks": picks, "zero_picks": int(zeros.sum()), "zero_share": float(zeros.sum() / picks) if picks else 0.0,
            "mean_recall": float(finite.mean()) if finite is not None and finite.size else None}


def recall_series(probe: dict) -> np.ndarray | None:
    """Per query selection recall (NaN where the query saw no entry), or None when not recorded."""
    got = probe.get("selection_recall")
    if got is None:
        return None
    return np.asarray([np.nan if v is None else v for v in got], dtype=np.float32)


def entry_label(entry: int, ratio: int, tokens: list[str]) -> str:
    a, b = entry * ratio, min(entry * ratio + ratio, len(tokens)) - 1
    text = "".join(tokens[a:b + 1])[:24].replace("\n", "⏎") if a < len(tokens) else ""
    span = f"token {a}" if a == b else f"tokens {a}-{b}"
    return f"entry {entry} ({span}: {text!r})"


def scores_figure(qs: QueryScores, ratio: int, tokens: list[str], height: int = 260) -> Figure:
    """Ranked bars: the picks (blue; ties orange) then the best unpicked entries (grey), the k-th
    pick's score as a line. Index scores are ReLU'd dot products summed over index heads (no unit).
    A pick from outside the candidate pool has no finite score: drawn at 0 with a cross on top,
    labelled OUTSIDE_LABEL (OUTSIDE_UNTIED where the engine marks no tie)."""
    rows = [(j, 0.0 if out else s, TIED if t else PICK,
             (OUTSIDE_LABEL if t else OUTSIDE_UNTIED) if out else "tie" if t else "picked")
            for (j, s), t, out in zip(qs.picks, qs.tied, qs.outside)]
    rows += [(j, s, RUNNER, "not picked") for j, s in qs.runners or []]
    x = np.arange(1, len(rows) + 1, dtype=np.int32)
    fig = Figure([dict(type="bar", x=x, y=np.asarray([r[1] for r in rows], dtype=np.float32),
                       marker=dict(color=[r[2] for r in rows], line=dict(width=0)),
                       customdata=[f"{entry_label(r[0], ratio, tokens)} · {r[3]}" for r in rows],
                       hovertemplate="rank %{x}: %{customdata}<br>index score %{y:.4g}<extra></extra>",
                       showlegend=False)])
    for name, colour in (("picked", PICK), ("tie (score shared with unpicked entries)", TIED), ("not picked", RUNNER)):
        fig.add_trace(dict(type="bar", x=[None], y=[None], name=name, marker=dict(color=colour), hoverinfo="skip"))
    # a mark on each bar's top: a pick scored 0 (the common tie) has no bar height to show it by
    symbols = ["x" if out else "diamond" for out in qs.outside] + ["diamond"] * len(qs.runners or [])
    fig.add_trace(dict(type="scatter", x=x, y=fig.data[0]["y"], mode="markers", showlegend=False, hoverinfo="skip",
                       marker=dict(color=[r[2] for r in rows], size=7, symbol=symbols, line=dict(width=0))))
    shapes = []
    if qs.kth is not None and qs.kth > OUTSIDE_POOL:
        shapes.append(dict(type="line", xref="x domain", x0=0, x1=1, y0=qs.kth, y1=qs.kth,
                           line=dict(color=KTH, width=1.2, dash="dash")))
    if qs.picks and qs.runners:
        k = len(qs.picks)
        shapes.append(dict(type="line", x0=k + 0.5, x1=k + 0.5, yref="paper", y0=0, y1=1,
                           line=dict(color=MUTED, width=1, dash="dot")))
    fig.update_layout(**base_layout(
        height=height, showlegend=True, bargap=0.1, shapes=shapes, margin=dict(l=58, r=8, t=8, b=44),
        legend=dict(orientation="h", y=1.02, yanchor="bottom", font=dict(size=10)),
        xaxis=dict(title=dict(text=f"rank among query {qs.query}'s entries (picks, then the best unpicked)",
                              font=dict(size=11, color=MUTED)), gridcolor=GRID),
        yaxis=dict(title=dict(text="index score", font=dict(size=11, color=MUTED)), gridcolor=GRID),
        hovermode="closest"))
    return fig


def prompt_figure(probe: dict, query: int | None = None, height: int = 220) -> Figure:
    """Across the prompt: zero-score picks per query (left axis) and selection recall (right, 0-1)."""
    zeros = zero_score_counts(probe)
    T = len(zeros)
    pos = np.arange(T, dtype=np.int32)
    fig = Figure([dict(type="scatter", x=pos, y=zeros, mode="lines", name="zero-score picks",
                       line=dict(color=TIED, width=1.3),
                       hovertemplate="query %{x}: %{y} picks scored 0<extra></extra>")])
    recall = recall_series(probe)
    layout = {}
    if recall is not None:
        fig.add_trace(dict(type="scatter", x=pos, y=recall, mode="lines", name="selection recall", yaxis="y2",
                           line=dict(color=PICK, width=1.3),
                           hovertemplate="query %{x}: recall %{y:.3f}<extra></extra>"))
        layout["yaxis2"] = dict(overlaying="y", side="right", range=[0, 1.02], dtick=0.25, showgrid=False,
                                title=dict(text="recall (share of mass)", font=dict(size=11, color=MUTED)))
    shapes = [dict(type="line", x0=query, x1=query, yref="paper", y0=0, y1=1, line=dict(color=INK, width=1))] \
        if query is not None and 0 <= query < T else []
    fig.update_layout(**base_layout(
        height=height, showlegend=True, shapes=shapes, margin=dict(l=52, r=52 if recall is not None else 8, t=8, b=44),
        legend=dict(orientation="h", y=1.02, yanchor="bottom", font=dict(size=10)),
        xaxis=dict(title=dict(text="query position", font=dict(size=11, color=MUTED)), gridcolor=GRID),
        yaxis=dict(title=dict(text="zero-score picks", font=dict(size=11, color=MUTED)), gridcolor=GRID,
                   rangemode="tozero"),
        hovermode="x unified", **layout))
    return fig


TIE_BREAK = {   # per numerics (engine/ops): who takes the picks tied at the k-th score
    "reference": "ties at the k-th score were resolved by torch.topk over the full row, as the official "
                 "reference does (not by position)",
    "fp32": "ties at the k-th score went to the lower positions",
}


def scores_caption(qs: QueryScores, layer: int, source: int, numerics: str | None = None) -> str:
    """One sentence under the ranked bars: what a bar means, and this query's numbers. `numerics` is the
    run JSON's "numerics" (None: a run stored before the field, computed in fp32): who takes a tie."""
    if not qs.picks:
        return f"Query {qs.query} sees no global entry yet, so it picked nothing."
    where = f"layer {source}'s indexer" if source != layer else "the indexer"
    numerics = numerics or STORED_BEFORE_NUMERICS
    rule = TIE_BREAK.get(numerics, "its top-k chose among the tied entries")
    kth = qs.kth
    pick = "k-th pick" if qs.probe_kth is not _NO_PROBE else "weakest pick"   # a run without topk_kth
    if kth is None:
        line = f"no dashed line: query {qs.query} has {len(qs.picks)} picks, fewer than k = {qs.k}, so no k-th score"
    elif kth <= OUTSIDE_POOL:
        line = f"no dashed line: the {pick} is {OUTSIDE_LABEL}"
    else:
        line = f"the dashed line is the {pick}'s score ({kth:.4g})"
    parts = [f"Each bar is one entry's score from {where} for query {qs.query}: blue bars were picked, orange "
             f"picks are ties (their score is shared by unpicked entries, so which were taken is arbitrary: "
             f"in this run ({numerics} numerics) {rule}), grey bars are the best unpicked entries; {line}."]
    n_out = sum(qs.outside)
    if n_out:
        parts.append(f"{n_out} of {len(qs.picks)} picks {'is' if n_out == 1 else 'are'} {OUTSIDE_LABEL}: the pool "
                     f"held fewer visible entries than k, so the top-k filled the rest from visible entries outside "
                     f"it (drawn at 0, marked ×).")
    if qs.margin is not None:
        parts.append(f"Best unpicked: {qs.best_unpicked:.4g} (margin {qs.margin:.4g}).")
    elif qs.runners is None:
        parts.append("Press “Score the unpicked entries” to see the runner-ups and the recall.")
    if qs.zero_picks:
        parts.append(f"{qs.zero_picks} of {len(qs.picks)} picks scored exactly 0.")
    return " ".join(parts)


# -- routing ------------------------------------------------------------------------------------

@dataclass
class RoutingMargin:
    """One token's experts ranked by gate score: the chosen ones and the best of the rest."""
    token: int
    chosen: list[tuple[int, float]]   # (expert, gate score), best first
    others: list[tuple[int, float]]   # the best unchosen, best first


def routing_margin(probe: dict, t: int, n_others: int = 6) -> RoutingMargin:
    r = probe.get("routing") or {}
    experts, scores = r.get("experts"), r.get("scores")
    if experts is None or scores is None:
        raise SelectionError("the run recorded no gate scores for this layer")
    if not 0 <= t < len(experts):
        raise SelectionError(f"token {t} is outside the routing probe (0..{len(experts) - 1})")
    row = [float(v) for v in scores[t]]
    chosen = {int(e) for e in experts[t]}
    ranked = sorted(range(len(row)), key=lambda e: (-row[e], e))
    return RoutingMargin(t, [(e, row[e]) for e in ranked if e in chosen],
                         [(e, row[e]) for e in ranked if e not in chosen][:n_others])


def routing_margins(probe: dict) -> np.ndarray:
    """Per token: weakest chosen expert's gate score minus the best unchosen one's (negative where the
    balance bias, which only picks, chose an expert below an unchosen one)."""
    r = probe.get("routing") or {}
    experts, scores = r.get("experts"), r.get("scores")
    if experts is None or scores is None:
        raise SelectionError("the run recorded no gate scores for this layer")
    s = np.asarray(scores, dtype=np.float32)
    e = np.asarray(experts, dtype=np.int64)
    chosen = np.zeros_like(s, dtype=bool)
    np.put_along_axis(chosen, e, True, axis=1)
    weakest = np.where(chosen, s, np.inf).min(1)
    best_other = np.where(chosen, -np.inf, s).max(1)
    return (weakest - best_other).astype(np.float32)


def routing_figure(probe: dict, t: int, height: int = 240) -> Figure:
    """Left: token t's chosen experts and the next best by gate score, the weakest chosen as a line.
    Right: the margin per token across the prompt."""
    m = routing_margin(probe, t)
    rows = [(e, s, PICK, "chosen") for e, s in m.chosen] + [(e, s, RUNNER, "not chosen") for e, s in m.others]
    margins = routing_margins(probe)
    pos = np.arange(len(margins), dtype=np.int32)
    fig = Figure([
        dict(type="bar", x=[f"e{e}" for e, *_ in rows], y=np.asarray([r[1] for r in rows], dtype=np.float32),
             marker=dict(color=[r[2] for r in rows]), customdata=[r[3] for r in rows], showlegend=False,
             hovertemplate="expert %{x} (%{customdata}): gate score %{y:.4f}<extra></extra>"),
        dict(type="scatter", x=pos, y=margins, mode="lines", xaxis="x2", yaxis="y2", showlegend=False,
             line=dict(color=PICK, width=1.2), hovertemplate="token %{x}: margin %{y:.4f}<extra></extra>")])
    weakest = m.chosen[-1][1] if m.chosen else None
    shapes = [dict(type="line", xref="x domain", x0=0, x1=1, y0=weakest, y1=weakest,
                   line=dict(color=KTH, width=1.2, dash="dash"))] if weakest is not None else []
    shapes += [dict(type="line", xref="x2", yref="y2 domain", x0=t, x1=t, y0=0, y1=1, line=dict(color=INK, width=1)),
               dict(type="line", xref="x2 domain", yref="y2", x0=0, x1=1, y0=0, y1=0, line=dict(color=MUTED, width=1))]
    title = dict(font=dict(size=11, color=MUTED))
    fig.update_layout(**base_layout(
        height=height, shapes=shapes, margin=dict(l=52, r=8, t=8, b=44), hovermode="closest",
        xaxis=dict(domain=[0, 0.42], title=dict(title, text=f"token {t}'s experts, by gate score")),
        yaxis=dict(title=dict(title, text="gate score"), gridcolor=GRID),
        xaxis2=dict(domain=[0.52, 1], anchor="y2", title=dict(title, text="token position"), gridcolor=GRID),
        yaxis2=dict(anchor="x2", title=dict(title, text="weakest chosen − best other"), gridcolor=GRID)))
    return fig


def routing_caption(m: RoutingMargin, n_active: int) -> str:
    if not m.chosen:
        return f"Token {m.token} chose no routed expert."
    gap = m.chosen[-1][1] - m.others[0][1] if m.others else None
    text = (f"Left: token {m.token}'s {n_active} chosen experts (blue) and the best of the rest (grey) by gate score; "
            f"the dashed line is the weakest chosen one. Right: that margin per token (below 0 where the balance "
            f"bias, which only picks experts, chose one scoring under an unchosen one).")
    if gap is not None:
        text += f" Token {m.token}'s margin: {gap:.4f}."
    return text


def selection_figure(qs: QueryScores, probe: dict, ratio: int, tokens: list[str], height: int = 280) -> Figure:
    """One chart, two panels (one browser draw per click): the query's ranked scores on the left,
    zero-score picks and recall across the prompt on the right."""
    left, right = scores_figure(qs, ratio, tokens, height), prompt_figure(probe, qs.query, height)
    lay, rlay = left.layout, right.layout
    traces = list(left.data)
    for t in right.data:
        traces.append(dict(t, xaxis="x2", yaxis="y3" if t.get("yaxis") == "y2" else "y2",
                           legendgroup="prompt"))
    layout = dict(lay, xaxis=dict(lay["xaxis"], domain=[0, 0.5]),
                  xaxis2=dict(rlay["xaxis"], domain=[0.58, 0.95], anchor="y2"),
                  yaxis2=dict(rlay["yaxis"], anchor="x2"),
                  shapes=list(lay.get("shapes") or []) + [dict(s, xref="x2") for s in rlay.get("shapes") or []],
                  margin=dict(l=58, r=52, t=8, b=44))
    if "yaxis2" in rlay:
        layout["yaxis3"] = dict(rlay["yaxis2"], overlaying="y2", anchor="x2")
    return Figure(traces, layout)
