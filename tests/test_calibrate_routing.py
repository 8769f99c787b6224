"""scripts/calibrate_routing.py: the bias solve on fixed router scores."""

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
spec = importlib.util.spec_from_file_location("calibrate_routing", SCRIPTS / "calibrate_routing.py")
cal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cal)


def test_loads_count_each_tokens_top_k_after_the_bias():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 50, 8, generator=g)
    bias = torch.randn(3, 8, generator=g) * 0.1
    got = cal.loads(scores, bias, 2)
    for L in range(3):
        want = torch.bincount((scores[L] + bias[L]).topk(2, -1).indices.flatten(), minlength=8).float()
        assert torch.equal(got[L], want)
    assert torch.equal(got.sum(-1), torch.full((3,), 100.0))


def test_balance_evens_skewed_loads_and_keeps_an_even_layer_even():
    g = torch.Generator().manual_seed(1)
    skewed = torch.rand(2000, 16, generator=g) + torch.linspace(0, 1.0, 16)  # high experts preferred
    even = torch.rand(2000, 16, generator=g)
    scores = torch.stack([skewed, even])
    before = cal.loads(scores, torch.zeros(2, 16), 4)
    bias = cal.balance(scores, torch.zeros(2, 16), 4)
    after = cal.loads(scores, bias, 4)
    share = lambda l: (l.min(-1).values / l.mean(-1), l.max(-1).values / l.mean(-1))
    assert share(before)[0][0] < 0.1                  # the skewed layer's least-used expert nearly idle
    lo, hi = share(after)
    assert lo.min() > 0.85 and hi.max() < 1.15, (lo, hi)
    assert bias[0, 0] > bias[0, -1]                   # the disfavoured expert got the larger bias


def test_rebalance_moves_only_the_named_layers():
    g = torch.Generator().manual_seed(2)
    scores = {L: torch.rand(1000, 8, generator=g) + torch.linspace(0, 1.0, 8) for L in range(3)}
    biases = {L: torch.zeros(8) for L in range(3)}
    out = cal.rebalance(scores, biases, 2, [1])
    assert out[0] is biases[0] and out[2] is biases[2]       # untouched layers keep their tensors
    load = cal.loads(scores[1], out[1], 2)
    assert float(load.min() / load.mean()) > 0.85         # the named layer is evened out
    before = cal.loads(scores[1], biases[1], 2)
    assert float(before.min() / before.mean()) < 0.2
