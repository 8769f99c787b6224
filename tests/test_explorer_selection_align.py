"""Token-aligned comparison of two prompts (explorer/token_align.py): a two-token edit shifts the
positions of everything after it; aligned, only the queries that see the edit differ."""

from __future__ import annotations

import pytest

from explorer import token_align as ta
from explorer.session_compare import compare_layer


def _run(tokens: list[str], ratio: int = 1) -> dict:
    """Each query picks the entries of the previous token and of the nearest earlier 'x' (content-based)."""
    topk = []
    for q in range(len(tokens)):
        picks = set()
        if q >= 1:
            picks.add((q - 1) // ratio)
        xs = [t for t in range(q) if tokens[t] == "x"]
        if xs:
            picks.add(xs[-1] // ratio)
        topk.append(sorted(picks) + [-1] * (2 - len(picks)))
    return {"tokens": tokens, "layers": {"7": {"topk": topk, "compress_ratio": ratio, "role": "reindex"}}}


def _prompts():
    base = [f"w{i % 17}" if i % 9 else "x" for i in range(200)]
    edited = base[:20] + ["new", "words"] + base[20:]
    return base, edited


def test_alignment_pairs_the_shared_tokens():
    a, b = _prompts()
    al = ta.align_tokens(a, b)
    assert len(al.pairs) == 200 and al.only_a == [] and al.only_b == [20, 21]
    assert al.edits == [("insert", 20, 20, 20, 22)]
    assert al.pairs[25] == (25, 27)
    assert ta.edits_text(al, a, b) == ["inserted 'newwords' (B 20-21, after A 19)"]
    swapped = ta.align_tokens(["a", "b", "c"], ["a", "z", "c"])
    assert swapped.pairs == [(0, 0), (2, 2)] and swapped.edits == [("replace", 1, 2, 1, 2)]


@pytest.mark.parametrize("ratio", [1, 2])
def test_a_two_token_edit_differs_only_next_to_the_edit(ratio):
    a, b = _prompts()
    run_a, run_b = _run(a, ratio), _run(b, ratio)
    naive = compare_layer(run_a, run_b, 7)                       # position by position
    aligned = ta.aligned_selections(run_a, run_b, 7)
    naive_differ = len(naive.selection_diff_positions)
    assert aligned.only_b_tokens == 2 and aligned.compared == 199
    # only the query right after the insertion sees a new previous token (an even shift keeps the
    # ratio-2 groups whole)
    assert aligned.differ == [20] and aligned.jaccard > 0.99
    assert naive_differ > 100     # what the position-by-position comparison said
    assert aligned.routing_jaccard is None          # these runs recorded no routing
    lines = ta.aligned_summary(aligned)
    assert "200 tokens in both prompts, 0 only in A, 2 only in B (1 edit)" in lines[0]


def test_missing_layer_or_selections_is_a_clear_message():
    a, _ = _prompts()
    with pytest.raises(ta.AlignError, match="no probes for layer 3"):
        ta.aligned_selections(_run(a), _run(a), 3)
    bare = {"tokens": a, "layers": {"7": {"topk": None}}}
    with pytest.raises(ta.AlignError, match="no selections in B"):
        ta.aligned_selections(_run(a), bare, 7)


def test_routing_overlap_at_aligned_tokens():
    a, b = _prompts()
    run_a, run_b = _run(a), _run(b)
    # experts by token content: the same token routes the same way in both prompts, whatever its position
    for run in (run_a, run_b):
        run["layers"]["7"]["routing"] = {"experts": [[hash(t) % 7, 7 + len(t) % 3] for t in run["tokens"]]}
    run_b["layers"]["7"]["routing"]["experts"][30] = [0, 1]     # one token routed differently in B
    got = ta.aligned_selections(run_a, run_b, 7)
    e30 = set(run_a["layers"]["7"]["routing"]["experts"][28])  # A 28 pairs with B 30
    want = (199 + len(e30 & {0, 1}) / len(e30 | {0, 1})) / 200
    assert got.routing_jaccard == pytest.approx(want)
    assert "Routed experts at the aligned tokens overlap" in ta.aligned_summary(got)[-1]
