"""The training Sinkhorn kernels (kernels/sinkhorn.py) on the CPU under TRITON_INTERPRET=1: forward and
backward against float64 PyTorch (the engine's sinkhorn and its autograd gradient), token counts that
do not fill a block, outputs NaN-poisoned so an unwritten element fails, and the op's autograd."""

from interpreted import interpreted  # first: the interpreter before triton

import random

import pytest
import torch

from engine.model import mhc

sk = interpreted("sinkhorn")


def _logits(t: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # the trainer's range: comb logits near the identity's 4.0 diagonal, plus noise
    return torch.randn(t, 4, 4, generator=gen) * 2.0 + torch.eye(4) * 4.0


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(b).any(), "NaN in the kernel's output (unwritten or invalid)"
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.parametrize("t", [1, 5, 64, 130])
def test_forward_matches_the_engine_sinkhorn_in_float64(poisoned, t):
    seed = random.randrange(2**31)
    z = _logits(t, seed)
    want = mhc.sinkhorn(z.double(), 20, 1e-6)          # the engine's own Sinkhorn, the reference
    got = sk.sinkhorn_forward(z, 20, 1e-6)
    assert got.shape == (t, 4, 4)
    assert _rel(want, got) < 1e-6, f"seed {seed}"
    # what Sinkhorn is for: columns sum to 1 (the last step is a column normalisation)
    assert torch.allclose(got.sum(-2), torch.ones(t, 4), atol=1e-5), f"seed {seed}"
    # rows only approach 1 after 20 rounds on sharp logits (a few draws in a thousand stay >2% off, in
    # float64 too): the kernel's row sums are the reference's, whatever they are
    assert torch.allclose(got.sum(-1).double(), want.sum(-1), atol=1e-5), f"seed {seed}"


@pytest.mark.parametrize("t,iters", [(3, 20), (70, 20), (9, 3), (4, 1)])
def test_backward_matches_autograd_of_the_float64_reference(poisoned, t, iters):
    seed = random.randrange(2**31)
    z = _logits(t, seed)
    g = torch.randn(t, 4, 4, generator=torch.Generator().manual_seed(seed + 1))
    z64 = z.double().requires_grad_(True)
    (want,) = torch.autograd.grad(mhc.sinkhorn(z64, iters, 1e-6), z64, g.double())
    got = sk.sinkhorn_backward(z, g, iters, 1e-6)
    assert _rel(want, got) < 1e-5
    # a softmax input: every row's gradient sums to 0
    assert got.sum(-1).abs().max() < 1e-5


def test_the_op_is_differentiable_and_rejects_wrong_shapes():
    z = _logits(6, 3).requires_grad_(True)
    out = sk.sinkhorn(z, 20, 1e-6)
    g = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(4))
    out.backward(g)
    z64 = z.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(mhc.sinkhorn(z64, 20, 1e-6), z64, g.double())
    assert _rel(want, z.grad) < 1e-5
    assert _rel(mhc.sinkhorn(z.detach().double(), 20, 1e-6), out.detach()) < 1e-6
    with pytest.raises(ValueError, match=r"float32 \[T, 4, 4\]"):
        sk.sinkhorn_forward(torch.zeros(2, 3, 3), 20, 1e-6)
    with pytest.raises(ValueError, match=r"float32 \[T, 4, 4\]"):
        sk.sinkhorn_forward(torch.zeros(2, 4, 4, dtype=torch.float64), 20, 1e-6)
    assert sk.sinkhorn_forward(torch.zeros(0, 4, 4), 20, 1e-6).shape == (0, 4, 4)
