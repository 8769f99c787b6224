"""explorer/ced_view.py: the serving-prefill comparison of a decoder layer at the generated tokens."""

from __future__ import annotations

import numpy as np
import pytest

from engine.run.api import Engine
from engine.roles import decoder_start
from engine.checkpoint.weights import TensorWeights, random_weights
from explorer import ced_view
from tests.engine_helpers import IdentityTokenizer, random_ids, tiny_config

CFG = tiny_config()
SPLIT = decoder_start(CFG)


@pytest.fixture(scope="module")
def runs():
    eng = Engine(CFG, TensorWeights(random_weights(CFG, 1)), IdentityTokenizer(CFG.engram_compressed_vocab_size),
                 threads=1, numerics="fp32")
    ids = random_ids(CFG, 48, seed=5).tolist()
    layers = list(range(SPLIT, CFG.n_layers))
    full = eng.run(ids, layers=layers, generate=6, generated_probes=True)
    forced = dict(layers=layers, generated_probes=True, continuation=full.generated_ids, prefill="ced")
    return (full, eng.run(ids, replay=len(ids), **forced), eng.run(ids, replay=2, **forced))


def test_set_agreements_by_hand():
    np.testing.assert_allclose(ced_view.jaccard_rows([[1, 2, 3, -1], [-1, -1, -1, -1]], [[2, 3, 4, 5], [-1, -1, -1, -1]]),
                               [2 / 5, 1.0])
    np.testing.assert_allclose(ced_view.overlap_rows([[0, 1, 2], [4, 5, 6]], [[2, 1, 7], [7, 8, 9]]), [2 / 3, 0.0])
    assert ced_view.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert ced_view.first_divergence([1, 2], [1, 2, 4]) == 2
    assert ced_view.first_divergence([5], [6]) == 0


def test_a_replay_over_the_whole_prompt_agrees_everywhere(runs):
    full, whole, _ = runs
    for layer in range(SPLIT, CFG.n_layers):
        cmp = ced_view.compare(full.to_json(), whole.to_json(), layer)
        assert cmp.steps == 6 and cmp.replay == 48
        assert cmp.jaccard.tolist() == [1.0] * 6 and cmp.routing_agreement.tolist() == [1.0] * 6
        assert cmp.diverges_at == 6 and cmp.ced_picks == cmp.full_picks


def test_a_short_replay_is_measured_against_the_tensors(runs):
    full, _, short = runs
    changed = 0
    for layer in range(SPLIT, CFG.n_layers):
        cmp = ced_view.compare(full.to_json(), short.to_json(), layer, token_text=lambda ids: [f"<{i}>" for i in ids])
        a, b = full.generated_layers[layer], short.generated_layers[layer]
        for g in range(cmp.steps):
            sa = {int(v) for v in a.topk[g] if v >= 0}
            sb = {int(v) for v in b.topk[g] if v >= 0}
            assert cmp.jaccard[g] == pytest.approx(len(sa & sb) / len(sa | sb))
            ea, eb = set(a.routing["experts"][g].tolist()), set(b.routing["experts"][g].tolist())
            assert cmp.routing_agreement[g] == pytest.approx(len(ea & eb) / len(ea))
        changed += int((cmp.jaccard < 1).sum() + (cmp.routing_agreement < 1).sum())
        assert cmp.tokens == [f"<{i}>" for i in full.generated_ids[:cmp.steps]]
        summary = cmp.summary()
        assert summary["time_ratio"] == pytest.approx(short.prefill_s / full.prefill_s)
        assert summary["topk_jaccard"] == pytest.approx(float(cmp.jaccard.mean()))
        ced_view.side_by_side_figure(cmp).validated()
        ced_view.agreement_figure(cmp).validated()
    assert changed > 0  # a 2-token replay changes what the decoder picks somewhere


def test_side_by_side_marks_shared_and_one_sided_picks(runs):
    full, _, short = runs
    cmp = ced_view.compare(full.to_json(), short.to_json(), SPLIT)
    fig = ced_view.side_by_side_figure(cmp)
    by_name = {}
    for trace in fig.data:
        by_name.setdefault((trace.xaxis, trace.name), []).append(trace)
    only_full = by_name[("x", "only full")][0]
    only_ced = by_name[("x2", "only ced")][0]
    expected_full = sum(len(set(r[r >= 0]) - set(o)) for r, o in zip(cmp.full_topk, cmp.ced_topk))
    expected_ced = sum(len(set(r[r >= 0]) - set(o)) for r, o in zip(cmp.ced_topk, cmp.full_topk))
    assert len(only_full.y) == expected_full and len(only_ced.y) == expected_ced
    assert "prefill" in fig.layout.annotations[0]["text"]


def test_decoder_note_and_errors(runs):
    assert ced_view.decoder_note(SPLIT - 1, SPLIT, 8) is None
    note = ced_view.decoder_note(SPLIT + 1, SPLIT, 8)
    assert f"layer {SPLIT + 1} does not run on prompt tokens" in note and "teacher-forced" in note and "8" in note
    full, whole, _ = runs
    with pytest.raises(ced_view.ComparisonError, match="full-prefill run and a CED-prefill run"):
        ced_view.compare(whole.to_json(), full.to_json(), SPLIT)
    with pytest.raises(ced_view.ComparisonError, match="no probes at the generated tokens"):
        ced_view.compare(full.to_json(), whole.to_json(), 0)
