"""Ties shown for what they are (issue 15, Deliver 2) in explorer/selection_view.py: the k-th score is
the engine's `topk_kth` probe, every pick of a query is kept (a Reindex layer's picks from outside its
candidate pool score -inf, None in JSON, and are labelled), and the caption says who takes a tie in the
run's numerics. Hand-made probes with known answers, a real run of the tiny engine checked against its
own candidate pool, and the page itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from explorer import selection_view as sel

OUT = "outside the candidate pool (tied at -inf)"

# k = 4. Query 0: a full row whose last two picks (entries 7, 2) come from outside the pool (None = -inf),
# so the engine's k-th score is -inf (None in JSON). Query 1: two picks and two -1 (not yet visible):
# fewer than k picks, no k-th score (also None). Query 2: four finite picks, k-th 0.1.
PROBE = {
    "topk": [[5, 7, 3, 2], [0, 1, -1, -1], [0, 1, 2, 3]],
    "topk_scores": [[0.5, None, 0.25, None], [0.3, 0.6, None, None], [0.9, 0.1, 0.4, 0.2]],
    "topk_kth": [None, None, 0.1],
    "topk_tied": [[False, True, False, True], [False, False, False, False], [False, False, False, False]],
}


def test_every_pick_is_kept_and_outside_the_pool_ones_are_marked():
    qs = sel.query_scores(PROBE, 0)
    # best first by score, the two -inf picks last (in entry order)
    assert qs.picks == [(5, 0.5), (3, 0.25), (2, -math.inf), (7, -math.inf)]
    assert qs.outside == [False, False, True, True]
    assert qs.tied == [False, False, True, True]           # the engine's marks follow the sort
    assert len(qs.picks) == 4 == qs.k
    short = sel.query_scores(PROBE, 1)
    assert short.picks == [(1, 0.6), (0, 0.3)] and short.outside == [False, False]   # -1 padding is not a pick


def test_the_kth_score_is_the_probes_not_the_weakest_shown_pick():
    full, short, plain = (sel.query_scores(PROBE, q) for q in range(3))
    assert full.kth == -math.inf       # the probe: the 4th pick is outside the pool (the weakest finite is 0.25)
    assert short.kth is None           # the probe: fewer than k picks, no k-th score (the weakest is 0.3)
    assert plain.kth == pytest.approx(0.1)
    assert full.margin is None and short.margin is None
    # a run stored before the tie probes: the weakest shown pick stands in
    old = {k: PROBE[k] for k in ("topk", "topk_scores")}
    assert sel.query_scores(old, 1).kth == pytest.approx(0.3)
    assert sel.query_scores(old, 0).kth == -math.inf


def test_figure_draws_outside_picks_at_zero_with_their_label_and_no_kth_line():
    qs = sel.query_scores(PROBE, 0)
    fig = sel.scores_figure(qs, 1, [f"t{i}" for i in range(8)])
    fig.validated()
    bars, marks = fig.data[0], next(t for t in fig.data if t["type"] == "scatter")
    assert list(bars.y) == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert [c.split(" · ")[1] for c in bars.customdata] == ["picked", "picked", OUT, OUT]
    assert list(marks.marker.symbol) == ["diamond", "diamond", "x", "x"]
    assert bars.marker.color == [sel.PICK, sel.PICK, sel.TIED, sel.TIED]
    assert not [s for s in fig.layout.shapes or [] if s.get("xref") == "x domain"]   # no k-th line at -inf
    # a lone outside pick the engine does not mark tied is not called a tie
    lone = sel.query_scores({"topk": [[4, 6]], "topk_scores": [[0.2, None]], "topk_kth": [None],
                             "topk_tied": [[False, False]]}, 0)
    assert sel.scores_figure(lone, 1, ["t"] * 8).data[0].customdata[1].endswith("outside the candidate pool (score -inf)")
    plain = sel.scores_figure(sel.query_scores(PROBE, 2), 1, [f"t{i}" for i in range(8)])
    assert [s["y0"] for s in plain.layout.shapes if s.get("xref") == "x domain"] == [pytest.approx(0.1)]


def test_caption_says_who_takes_a_tie_in_the_runs_numerics():
    qs = sel.query_scores(PROBE, 2)
    ref = sel.scores_caption(qs, 7, 7, "reference")
    assert "reference numerics" in ref and "torch.topk over the full row" in ref
    assert "official reference" in ref and "not by position" in ref
    assert "earlier position" not in ref and "lower position" not in ref
    fp32 = sel.scores_caption(qs, 7, 7, "fp32")
    assert "fp32 numerics" in fp32 and "went to the lower positions" in fp32 and "torch.topk" not in fp32
    assert sel.scores_caption(qs, 7, 7, None) == fp32      # a run stored before runs named their numerics
    assert "the dashed line is the k-th pick's score (0.1)" in ref


def test_caption_names_outside_picks_and_the_missing_kth():
    full = sel.scores_caption(sel.query_scores(PROBE, 0), 7, 7, "reference")
    assert f"no dashed line: the k-th pick is {OUT}" in full and f"2 of 4 picks are {OUT}" in full
    short = sel.scores_caption(sel.query_scores(PROBE, 1), 7, 7, "reference")
    assert "has 2 picks, fewer than k = 4, so no k-th score" in short and OUT not in short
    old = sel.scores_caption(sel.query_scores({k: PROBE[k] for k in ("topk", "topk_scores")}, 1), 7, 7)
    assert "the weakest pick's score (0.3)" in old


def _tiny_run(numerics: str) -> dict:
    from engine.checkpoint.weights import TensorWeights, random_weights
    from engine.run.api import Engine
    from tests.engine_helpers import IdentityTokenizer, random_ids, tiny_config
    cfg = tiny_config(index_topk=8)   # Reindex layer 7's pool (2 blocks of 4) is often short of 8 visible
    engine = Engine(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(cfg.engram_compressed_vocab_size),
                    numerics=numerics)
    return engine.run(random_ids(cfg, 40).tolist(), layers=[7]).to_json()


def test_a_reference_run_keeps_every_pick_and_flags_exactly_those_outside_its_pool():
    run = _tiny_run("reference")
    assert run["numerics"] == "reference"
    probe = run["layers"]["7"]
    k = len(probe["topk"][0])
    seen_outside = seen_short = 0
    for q in range(len(probe["topk"])):
        qs = sel.query_scores(probe, q)
        picked = [j for j in probe["topk"][q] if j >= 0]
        pool = set(probe["candidate_pool"][q])
        assert sorted(j for j, _ in qs.picks) == sorted(picked)                 # none dropped
        assert {j for (j, _), out in zip(qs.picks, qs.outside) if out} == set(picked) - pool
        if len(picked) == k:
            weakest = min(s for _, s in qs.picks)
            assert qs.kth == weakest                     # the probe's k-th: -inf when an outside pick is k-th
        else:
            assert qs.kth is None
        if any(qs.outside):
            seen_outside += 1
            labels = sel.scores_figure(qs, 1, run["tokens"]).data[0].customdata
            assert sum("outside the candidate pool" in c for c in labels) == sum(qs.outside)
            assert "outside the candidate pool" in sel.scores_caption(qs, 7, 7, run["numerics"])
        seen_short += len(picked) < k
    assert seen_outside and seen_short


def test_an_fp32_run_has_no_outside_picks_and_its_caption_says_lower_positions():
    run = _tiny_run("fp32")
    probe = run["layers"]["7"]
    for q in range(len(probe["topk"])):
        qs = sel.query_scores(probe, q)
        assert not any(qs.outside) and len(qs.picks) == sum(j >= 0 for j in probe["topk"][q])
    assert "lower positions" in sel.scores_caption(sel.query_scores(probe, 39), 7, 7, run["numerics"])


def test_the_page_captions_the_runs_numerics(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest
    from explorer_synth import synthetic_layer, synthetic_run
    T = 30
    layer = synthetic_layer(T, k=4, n_experts=32, seed=2)
    layer["topk"][T - 1], layer["topk_scores"][T - 1] = [3, 5, 9, 11], [0.5, None, 0.0, 0.25]
    layer["topk_kth"] = [None] * T
    layer["topk_tied"] = [[False] * 4 for _ in range(T)]
    layer["topk_tied"][T - 1] = [False, True, False, False]
    shown = {}
    for numerics in ("reference", "fp32"):
        path = tmp_path / f"{numerics}.json"
        path.write_text(json.dumps({**synthetic_run(T, {24: layer}), "numerics": numerics}))
        monkeypatch.setenv("EXPLORER_RUN_JSON", str(path))
        monkeypatch.setenv("EXPLORER_SOURCE", "config")
        at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app.py"), default_timeout=60)
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        shown[numerics] = "\n".join(c.value for c in at.caption)
    assert "torch.topk over the full row" in shown["reference"] and f"1 of 4 picks is {OUT}" in shown["reference"]
    assert "lower positions" in shown["fp32"] and "torch.topk" not in shown["fp32"]


def test_glossary_names_each_numerics_tie_rule():
    """The glossary's top-k and tie entries must not claim the position rule for every run."""
    from explorer import glossary

    entries = {k.lower(): v for k, v in glossary.GLOSSARY.items()}
    assert "reference" in entries["top-k"] and "torch.topk" in entries["top-k"]
    assert "fp32" in entries["top-k"]
    assert "earlier position won" not in entries["tie"]
