"""The router's top-k kernel (kernels/router.py) on the CPU under TRITON_INTERPRET=1: the picks of torch.topk on
rows without ties (the release's 384 experts, a ragged width, a short batch), ties broken to the lower expert,
NaN ranked first; and the kernel ops' op behind its knob (TritonOps.route_topk), picks equal to the wrapped
numerics' in the tiny model's prefill."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

_, router = interpreted("_formats", "router")


@pytest.mark.parametrize("t, e, k, block_t", [(70, 384, 6, 16), (5, 384, 6, 16), (33, 100, 8, 4), (9, 7, 7, 16)])
def test_picks_are_torch_topk_on_rows_without_ties(t, e, k, block_t):
    gen = torch.Generator().manual_seed(t * e + k)
    biased = torch.randn(t, e, generator=gen).sqrt_().nan_to_num(0.5) + torch.randn(e, generator=gen) * 0.1
    biased = biased + torch.arange(e) * 1e-6  # no two equal values in a row
    got = router.route_topk_triton(biased, k, block_t=block_t)
    assert got.dtype == torch.int64 and got.shape == (t, k)
    assert torch.equal(got, torch.topk(biased, k, dim=-1).indices)
    assert torch.equal(got, router.route_topk_reference(biased, k))


def test_ties_go_to_the_lower_expert_and_nan_ranks_first():
    biased = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0],
                           [0.0, float("nan"), 5.0, float("-inf"), 5.0, -1.0],
                           [float("-inf")] * 4 + [1.0, 2.0]])
    got = router.route_topk_triton(biased, 4)
    assert got.tolist() == [[1, 2, 4, 5], [1, 2, 4, 0], [5, 4, 0, 1]]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="E >= k"):
        router.route_topk_triton(torch.zeros(4, 3), 4)
    with pytest.raises(ValueError, match="E >= k"):
        router.route_topk_triton(torch.zeros(4), 1)
    assert router.route_topk_triton(torch.zeros(0, 8), 2).shape == (0, 2)


def test_the_knob_sends_the_routers_choice_to_the_kernel(monkeypatch):
    """TritonOps.route_topk: the kernel's choice by default (router_topk), the same picks as torch.topk; with the
    knob off the wrapped numerics' torch.topk; rows wider than a program holds stay on torch.topk."""
    import engine.ops.triton as kernel_ops
    from engine.ops import ops_for

    monkeypatch.setattr(kernel_ops, "checkpoint_backed", lambda weights: True)
    ops = kernel_ops.TritonOps(ops_for("reference"), type("W", (), {"reader": None})(), "cpu")
    biased = torch.randn(40, 384, generator=torch.Generator().manual_seed(3))
    want = biased.topk(6, dim=-1).indices
    assert torch.equal(ops.route_topk(biased, 6), want) and ops.calls["route_topk"] == 1
    ops.route_topk(torch.randn(4, 8192), 6)
    assert ops.calls["route_topk"] == 1
    ops.set_knobs("router_topk=0")
    assert torch.equal(ops.route_topk(biased, 6), want) and ops.calls["route_topk"] == 1


def test_the_tiny_models_prefill_routes_alike_on_the_kernel(tmp_path, monkeypatch):
    """With router_topk the tiny model's prefill on the kernel ops (the interpreted router kernel, the other
    kernels' references standing in) gives the logits, picks and routing of torch.topk's choice bit for bit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import engine.ops.triton as kernel_ops
    import kernels.dispatch as dispatch
    from engine.checkpoint.reader import CheckpointReader
    from engine.checkpoint.weights import CheckpointWeights
    from engine.model.transformer import Model
    from engine.run.probes import ProbeRequest
    from engine_helpers import IdentityTokenizer, random_ids, tiny_config, write_tiny_checkpoint

    monkeypatch.setattr(kernel_ops, "interpreter_active", lambda: False)
    calls = []
    monkeypatch.setitem(dispatch._PAIRS, "route_topk",
                        (lambda *a, **k: (calls.append(1), router.route_topk_triton(*a, **k))[1], None))
    cfg = tiny_config()
    weights = CheckpointWeights(CheckpointReader(write_tiny_checkpoint(tmp_path, seed=5, n_shards=1), cfg))
    ids = random_ids(cfg, 48, seed=4)
    out = {}
    for knob in ("0", "1"):
        model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), numerics="reference",
                      kernels=True)
        model.ops.set_knobs(f"router_topk={knob}")
        collect = {}
        logits = model.forward(ids, probes=ProbeRequest(kinds={"topk", "routing"}), collect=collect)
        out[knob] = (logits, {L: (c.get("topk"), c["routing"]["experts"]) for L, c in collect.items()})
    assert calls and torch.equal(out["0"][0], out["1"][0])
    assert out["0"][1].keys() == out["1"][1].keys()
    for layer, (picks, experts) in out["0"][1].items():
        assert torch.equal(experts, out["1"][1][layer][1]), layer
        assert (picks is None) == (out["1"][1][layer][0] is None)
