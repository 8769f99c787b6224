"""Side-by-side and replay comparison of probe results, checked against hand-worked examples."""

from __future__ import annotations

import copy

import pytest

from explorer.session_compare import CompareError, compare_layer, replay_report


def run(tokens, topk, experts, weights=None, pre=None, role="reindex", pool=None):
    """A one-layer (24) result shaped like RunResult.to_json()."""
    n = len(tokens)
    weights = weights or [[1 / len(e)] * len(e) for e in experts]
    pre = pre or [[0.25, 0.25, 0.25, 0.25] for _ in range(n)]
    mhc = {"pre": pre, "post": [[1.0, 0.5, 0.25, 0.125] for _ in range(n)],
           "comb": [[[1.0 if i == j else 0.0 for j in range(4)] for i in range(4)] for _ in range(n)]}
    return {
        "tokens": tokens,
        "token_ids": [10 + i for i in range(n)],
        "layers": {"24": {"role": role, "kv_source": 20, "index_source": 24, "topk": topk, "candidate_pool": pool,
                          "mhc": {"attn": copy.deepcopy(mhc), "ffn": copy.deepcopy(mhc)},
                          "routing": {"experts": experts, "weights": weights}}},
    }


A = run(["The", " cat", " sat"], topk=[[0], [0, 1], [2, 0, 1]],
        experts=[[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6]])
B = run(["The", " dog", " ran", " off"], topk=[[0], [1, 0], [0, 3, -1], [0, 1, 2, 3]],
        experts=[[6, 5, 4, 3, 2, 1], [7, 8, 9, 10, 11, 13], [100, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9, 9]])


def test_compare_layer_per_position():
    cmp = compare_layer(A, B, 24)
    assert (cmp.layer, cmp.n_positions_a, cmp.n_positions_b) == ("24", 3, 4)
    p0, p1, p2, p3 = cmp.positions
    # order inside a selection does not matter; -1 is padding
    assert not p0.selections_differ and not p1.selections_differ
    assert p2.selected_only_a == {1, 2} and p2.selected_only_b == {3} and p2.selected_common == {0}
    assert (p3.token_a, p3.token_b) == (None, " off")
    assert p3.selected_only_b == {0, 1, 2, 3} and p3.selected_only_a == frozenset()
    assert cmp.selection_diff_positions == [2, 3]

    assert not p0.routing_differs
    assert p1.experts_only_a == {12} and p1.experts_only_b == {13} and len(p1.experts_common) == 5
    assert p2.experts_only_a == {1} and p2.experts_only_b == {100}
    assert cmp.routing_diff_positions == [1, 2, 3]
    # Jaccard over the 3 shared positions: selections 1, 1, 1/4; experts 1, 5/7, 5/7
    assert cmp.mean_selection_overlap() == pytest.approx((1 + 1 + 0.25) / 3)
    assert cmp.mean_expert_overlap() == pytest.approx((1 + 5 / 7 + 5 / 7) / 3)


def test_compare_layer_missing_layer_and_missing_probes():
    with pytest.raises(CompareError, match="Layer 12 was not probed in run A and B"):
        compare_layer(A, B, 12)
    no_sel = copy.deepcopy(B)
    no_sel["layers"]["24"]["topk"] = None
    no_sel["layers"]["24"]["role"] = "window"
    cmp = compare_layer(A, no_sel, "24")
    assert not cmp.has_selections and cmp.selection_diff_positions == [] and cmp.mean_selection_overlap() is None
    assert any("only one run" in n for n in cmp.notes) and any("roles differ" in n for n in cmp.notes)


def test_replay_identical_with_reordered_sets_and_tiny_float_noise():
    new = copy.deepcopy(A)
    new["layers"]["24"]["topk"][2] = [1, 0, 2]
    new["layers"]["24"]["routing"]["experts"][0] = [6, 5, 4, 3, 2, 1]
    new["layers"]["24"]["routing"]["weights"][0] = [1 / 6 + 1e-7] * 6
    new["layers"]["24"]["mhc"]["attn"]["pre"][1][2] = 0.25 + 1e-6
    report = replay_report(A, new)
    assert report.identical, report.summary()
    assert report.sections["selections"].compared == 3
    assert report.sections["routing"].compared == 3
    assert report.sections["mhc"].compared == 2 * 3 * (4 + 4 + 16)
    assert report.summary().startswith("Replay identical")


def test_replay_lists_first_differences():
    new = copy.deepcopy(A)
    new["layers"]["24"]["topk"][1] = [0, 2]                      # selection changed at position 1
    new["layers"]["24"]["mhc"]["ffn"]["comb"][2][1][3] = 0.01     # over tolerance
    new["layers"]["24"]["routing"]["experts"][2] = [1, 2, 3, 4, 5, 99]
    new["layers"]["24"]["routing"]["weights"][1] = [0.5] + [0.1] * 5
    report = replay_report(A, new)
    assert not report.identical
    sel, mhc, rout = (report.sections[k] for k in ("selections", "mhc", "routing"))
    assert report.sections["tokens"].identical and report.sections["layers"].identical
    assert sel.n_differences == 1
    assert sel.differences[0] == "layer 24, position 1 (' cat'): selected only saved {1}, only replayed {2}"
    assert mhc.n_differences == 1 and "mHC ffn.comb[1][3] saved 0, replayed 0.01" in mhc.differences[0]
    assert "position 2 (' sat'): experts only saved {6}, only replayed {99}" in rout.differences[0]
    # expert 7's weight 1/6 -> 0.5; the other five 1/6 -> 0.1
    assert rout.n_differences == 1 + 6
    assert "weight of expert 7 saved 0.166667, replayed 0.5" in rout.differences[1]
    text = report.summary()
    assert "selections: 1 difference(s)" in text and "tokens: identical" in text


def test_replay_caps_the_listing_and_checks_tokens_and_layers():
    new = copy.deepcopy(A)
    new["token_ids"][0] = 999
    new["layers"]["24"]["kv_source"] = 21
    new["layers"]["25"] = copy.deepcopy(A["layers"]["24"])
    for q in range(3):
        new["layers"]["24"]["mhc"]["attn"]["pre"][q] = [0.0, 0.0, 0.0, 0.0]
    report = replay_report(A, new, max_listed=2)
    assert report.sections["tokens"].differences == ("token_ids[0]: saved 10, replayed 999",)
    assert report.sections["layers"].differences == (
        "layer 24: kv_source saved 20, replayed 21",
        "layer 25: replayed but not in the saved run",
    )
    mhc = report.sections["mhc"]
    assert mhc.n_differences == 12 and len(mhc.differences) == 2


def test_replay_shape_and_presence_changes():
    new = copy.deepcopy(A)
    new["layers"]["24"]["topk"] = new["layers"]["24"]["topk"][:2]
    new["layers"]["24"]["candidate_pool"] = [[0], [0, 1], [0, 1, 2]]
    new["layers"]["24"]["mhc"]["attn"]["pre"][0] = [0.25, 0.25]
    report = replay_report(A, new)
    sel = report.sections["selections"].differences
    assert "layer 24: selected for 3 positions saved, 2 replayed" in sel
    assert "layer 24: candidate_pool recorded in only one run" in sel
    assert any("shapes differ" in d for d in report.sections["mhc"].differences)


def test_replay_nan_equals_nan_only():
    a = copy.deepcopy(A)
    a["layers"]["24"]["mhc"]["attn"]["pre"][0][0] = float("nan")
    b = copy.deepcopy(a)
    assert replay_report(a, b).identical
    b["layers"]["24"]["mhc"]["attn"]["pre"][0][0] = 0.25
    assert replay_report(a, b).sections["mhc"].n_differences == 1
