"""The two-thread wavefront prefill (engine/run/pipeline.py) against the one-thread forward."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.run import pipeline
from engine.run.api import Engine
from engine.run.probes import ProbeRequest
from engine.checkpoint.weights import TensorWeights, random_weights
from engine_helpers import IdentityTokenizer, random_ids, release_lists_config, tiny_config, tiny_model


def _both_ways(cfg, T, first_share, image=None, seed=0):
    model = tiny_model(cfg, seed=seed)
    ids = random_ids(cfg, T, seed)
    mask = torch.zeros(T, dtype=torch.bool)
    if image is not None:
        mask[image[0]:image[1]] = True
    with torch.inference_mode():
        model.reset()
        one = {}
        logits = model.forward(ids, image_mask=mask, probes=ProbeRequest(), collect=one)
        bytes_one = model.cache_bytes()
        step_one = model.forward(random_ids(cfg, 1, seed + 1))
        model.reset()
        two = {}
        old = pipeline.FIRST_SHARE
        pipeline.FIRST_SHARE = first_share
        try:
            piped = pipeline.prefill(model, ids, mask, ProbeRequest(), two)
        finally:
            pipeline.FIRST_SHARE = old
        bytes_two = model.cache_bytes()
        step_two = model.forward(random_ids(cfg, 1, seed + 1))
    return model, (logits, one, bytes_one, step_one), (piped, two, bytes_two, step_two)


def _assert_same_run(model, a, b):
    (logits, one, bytes_one, step_one), (piped, two, bytes_two, step_two) = a, b
    scale = logits.abs().max()
    assert (piped - logits).abs().max() < 1e-4 * scale
    assert bytes_one == bytes_two  # the caches hold the same entries afterwards
    assert (step_two - step_one).abs().max() < 1e-4 * scale  # and decode goes on from them alike
    assert set(one) == set(two) == set(range(model.cfg.n_layers))
    for L in one:
        p, q = one[L], two[L]
        for key in ("topk", "candidate_pool"):
            if key in p:
                assert torch.equal(p[key], q[key]), (L, key)
        if "topk" in p:
            assert p["n_entries"] == q["n_entries"]
            assert torch.allclose(p["topk_scores"], q["topk_scores"], rtol=1e-4, atol=1e-5, equal_nan=True)
        assert torch.equal(p["routing"]["experts"], q["routing"]["experts"]), L
        for part in ("attn", "ffn"):
            for name in ("pre", "post", "comb"):
                assert torch.allclose(p["mhc"][part][name], q["mhc"][part][name], atol=1e-5), (L, part, name)
        assert torch.allclose(p["residual_norms"], q["residual_norms"], rtol=1e-4)


@pytest.mark.parametrize("first_share", [0.5, 0.31, 0.77])  # cuts on and off the m=2 groups
def test_wavefront_prefill_equals_the_one_thread_forward(first_share):
    cfg = tiny_config()
    model, a, b = _both_ways(cfg, 61, first_share, image=(20, 40))
    _assert_same_run(model, a, b)


def test_wavefront_on_the_release_plan_keeps_layer_20s_pool_and_reuse():
    cfg = release_lists_config()
    model, a, b = _both_ways(cfg, 300, 0.54)
    _assert_same_run(model, a, b)
    two = b[1]
    assert two[24]["topk"].shape == (300, 64)
    assert torch.equal(two[25]["topk"], two[24]["topk"])  # Reuse borrows the whole prompt's picks


def test_join_probes_pads_the_first_chunks_narrower_rows():
    first = {"topk": torch.tensor([[0, 1]]), "topk_scores": torch.tensor([[2.0, 1.0]]),
             "candidate_pool": torch.tensor([[True, False]]), "n_entries": 2, "time_s": 0.5}
    second = {"topk": torch.tensor([[0, 2, 3]]), "topk_scores": torch.tensor([[3.0, 2.0, 1.0]]),
              "candidate_pool": torch.tensor([[True, True, False, True]]), "n_entries": 4, "time_s": 0.25}
    joined = pipeline.join_probes(first, second)
    assert joined["topk"].tolist() == [[0, 1, -1], [0, 2, 3]]
    assert joined["topk_scores"][0, 2].item() == float("-inf")
    assert joined["candidate_pool"].tolist() == [[True, False, False, False], [True, True, False, True]]
    assert joined["n_entries"] == 4 and joined["time_s"] == 0.75


@pytest.mark.parametrize("failing_start", [0, 1])  # the caller's chunk, or the second thread's
def test_a_failing_chunk_raises_its_error_and_nothing_hangs(monkeypatch, failing_start):
    cfg = tiny_config()
    model = tiny_model(cfg)
    real = model.run_chunk

    def run_chunk(ids, start, *args, **kwargs):
        if (start > 0) == bool(failing_start):
            raise RuntimeError(f"chunk at {start} broke")
        return real(ids, start, *args, **kwargs)

    monkeypatch.setattr(model, "run_chunk", run_chunk)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="broke"):
        with torch.inference_mode():
            pipeline.prefill(model, random_ids(cfg, 40), None, ProbeRequest(), {})
    assert threading.active_count() == before  # the second thread has ended


def test_engine_uses_the_wavefront_for_long_prompts_only(monkeypatch):
    cfg = tiny_config()
    calls = []
    real = pipeline.prefill
    monkeypatch.setattr(pipeline, "prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    # fp32 numerics: ties go to the lower positions, so the two chunks pick exactly as one prompt does
    # (under reference numerics a tie is torch's topk's choice, marked tied: tests/test_numerics_model.py)
    engine = Engine(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(300), threads=2, numerics="fp32")
    single = Engine(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(300), threads=1, numerics="fp32")
    ids = random_ids(cfg, pipeline.MIN_TOKENS).tolist()
    a, b = engine.run(ids, layers=[7]), single.run(ids, layers=[7])
    assert calls == [1]
    assert torch.equal(a.layers[7].topk, b.layers[7].topk)
    engine.run(ids[:pipeline.MIN_TOKENS - 1], layers=[7])
    assert calls == [1]
    with pytest.raises(ValueError, match="threads must be 1 or 2"):
        Engine(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(300), threads=3)
