"""On-request selection probes (issue 13 item 4): zero-score picks, runner-ups and selection recall,
against plain float64 computations and the engine's own invariants."""

from __future__ import annotations

import math

import pytest
import torch

from engine.run.api import Engine, EngineError, LayerResult
from engine.model.selection_probe import runner_ups, selection_recall
from engine.checkpoint.weights import TensorWeights, random_weights
from tests.engine_helpers import IdentityTokenizer, random_ids, tiny_config


def _recall_reference(q, kv, visible, picks) -> list[float]:
    """Plain float64 loops: per query and head, softmax over the visible entries, mass on the picks."""
    out = []
    T, H, _ = q.shape
    for t in range(T):
        n = int(visible[t])
        if n <= 0:
            out.append(float("nan"))
            continue
        chosen = {int(j) for j in picks[t] if 0 <= int(j) < n}
        total = 0.0
        for h in range(H):
            logits = [sum(float(q[t, h, d]) * float(kv[j, d]) for d in range(q.shape[2])) for j in range(n)]
            top = max(logits)
            weights = [math.exp(v - top) for v in logits]
            total += sum(weights[j] for j in chosen) / sum(weights)
        out.append(total / H)
    return out


def test_selection_recall_equals_a_float64_softmax_mass():
    g = torch.Generator().manual_seed(3)
    T, H, D, N = 7, 3, 5, 9
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(N, D, generator=g)
    visible = torch.tensor([0, 1, 3, 4, 6, 9, 9])
    picks = torch.tensor([[-1, -1, -1], [0, -1, -1], [2, 0, -1], [1, 3, -1], [5, 0, 2], [8, 7, 1], [0, 1, 2]])
    got = selection_recall(q, kv, visible, picks).tolist()
    want = _recall_reference(q.double(), kv.double(), visible, picks)
    assert math.isnan(got[0]) and math.isnan(want[0])
    assert got[1] == pytest.approx(1.0, abs=1e-6)          # the only visible entry is picked
    assert got[1:] == pytest.approx(want[1:], abs=1e-5)
    assert all(0 < v < 1 for v in got[2:])


def test_runner_ups_are_the_best_unpicked_entries_in_position_order_on_ties():
    scores = torch.tensor([[0.5, 0.0, 0.0, 2.0, 0.0, float("-inf")],
                           [1.0, 3.0, float("-inf"), float("-inf"), float("-inf"), float("-inf")]])
    picks = torch.tensor([[3, 0], [1, -1]])
    entries, values = runner_ups(scores, picks, r=4)
    # row 0: everything but the picks, the three zeros in position order, then nothing (-inf)
    assert entries.tolist() == [[1, 2, 4, -1], [0, -1, -1, -1]]
    assert values[0, :3].tolist() == [0.0, 0.0, 0.0] and values[1, 0].item() == 1.0
    assert torch.isinf(values[0, 3]) and torch.isinf(values[1, 1:]).all()


def _engine(threads: int = 1, numerics: str | None = None):
    cfg = tiny_config()
    return Engine(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(300), threads=threads,
                  numerics=numerics)


def test_detail_probes_on_a_run_keep_their_invariants():
    engine = _engine()
    ids = random_ids(engine.cfg, 60).tolist()
    result = engine.run(ids, layers=[2, 3, 5, 7], detail_layers=[2, 3, 7])
    k = engine.cfg.index_topk
    for L in (2, 7):
        layer = result.layers[L]
        topk, scores = layer.topk, layer.topk_scores
        # zero-score picks: counted by hand from the scores
        assert layer.zero_score_picks.tolist() == [sum(1 for j, s in zip(topk[t].tolist(), scores[t].tolist())
                                                       if j >= 0 and s == 0.0) for t in range(len(ids))]
        for t in range(len(ids)):
            picked = {j for j in topk[t].tolist() if j >= 0}
            runners = [j for j in layer.runner_ups[t].tolist() if j >= 0]
            assert not picked & set(runners)
            if runners:   # nothing unpicked scores above the weakest pick
                weakest = min(s for j, s in zip(topk[t].tolist(), scores[t].tolist()) if j >= 0)
                assert layer.runner_up_scores[t, 0].item() <= weakest
            recall = layer.selection_recall[t].item()
            visible = (t + 1) // layer.compress_ratio
            if visible == 0:
                assert math.isnan(recall)
            elif visible <= k and L == 2:     # every visible entry picked: all the mass
                assert recall == pytest.approx(1.0, abs=1e-5)
            else:
                assert 0 <= recall <= 1 + 1e-6
    # a Reuse layer gets its own recall (its queries on the borrowed picks), no runner-ups of its own
    assert result.layers[3].selection_recall is not None and result.layers[3].runner_ups is None
    # asked only for some layers: the others carry no detail
    assert result.layers[5].selection_recall is None and result.layers[5].zero_score_picks is not None


def test_detail_travels_in_json_and_the_wire_form():
    engine = _engine()
    result = engine.run(random_ids(engine.cfg, 40).tolist(), layers=[7], detail_layers=[7])
    layer = result.layers[7]
    js = layer.to_json()
    assert len(js["selection_recall"]) == 40 and len(js["runner_ups"]) == 40
    assert js["zero_score_picks"] == layer.zero_score_picks.tolist()
    assert all(v is None or isinstance(v, float) for row in js["runner_up_scores"] for v in row)
    back = LayerResult.from_wire(layer.to_wire())
    assert torch.equal(back.runner_ups, layer.runner_ups)
    assert torch.allclose(back.selection_recall, layer.selection_recall, equal_nan=True)
    plain = engine.run(random_ids(engine.cfg, 40).tolist(), layers=[7]).layers[7].to_json()
    assert "selection_recall" not in plain and "runner_ups" not in plain


def test_detail_needs_a_probed_layer_with_topk():
    engine = _engine()
    with pytest.raises(EngineError, match="detail layers"):
        engine.run([5, 6, 7], layers=[2], detail_layers=[7])
    with pytest.raises(EngineError, match="detail layers"):
        engine.run([5, 6, 7], layers=[7], probes=("mhc",), detail_layers=[7])


def test_the_two_thread_wavefront_gives_the_same_detail():
    ids = random_ids(tiny_config(), 800, seed=2).tolist()
    # fp32 numerics: there the wavefront equals the one-thread forward (under the bf16 "reference"
    # numerics the two already pick differently, detail probes or not)
    one = _engine(1, "fp32").run(ids, layers=[7], detail_layers=[7]).layers[7]
    two = _engine(2, "fp32").run(ids, layers=[7], detail_layers=[7]).layers[7]
    assert torch.equal(one.topk, two.topk)
    assert torch.equal(one.runner_ups, two.runner_ups)
    assert torch.allclose(one.selection_recall, two.selection_recall, atol=1e-5, equal_nan=True)


def test_the_service_and_its_client_carry_detail_layers(monkeypatch):
    from engine.serve.service import run_args
    from explorer.remote import RemoteEngine
    args = run_args({"ids": [0, 5], "layers": [7], "detail_layers": [7]})
    assert args["detail_layers"] == [7]
    with pytest.raises(EngineError, match="'detail_layers' must be a list"):
        run_args({"ids": [0, 5], "detail_layers": "7"})
    sent = {}
    client = RemoteEngine.__new__(RemoteEngine)
    client.timeout = 5
    monkeypatch.setattr(client, "_call", lambda method, path, body, timeout, during="": sent.update(body) or
                        {"result": {"tokens": [], "layers": {}}}, raising=False)
    client.run([0, 5], layers=[7], detail_layers=[7])
    assert sent["detail_layers"] == [7] and sent["layers"] == [7]
