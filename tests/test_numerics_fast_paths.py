"""engine/ops/reference.py's faster formulations give the same bits as the straightforward ones they
replace (the engine's `reference` numerics must stay bit-identical to the official reference)."""

from __future__ import annotations

import pytest
import torch

from engine.ops import ops_for
from engine.ops.fp32 import Fp32Ops
from engine.ops.reference import to_bf16

REF = ops_for("reference")


class _Source:
    """The part of a SourceCache sparse_attention reads."""

    def __init__(self, kv_values: torch.Tensor):
        self.kv_values = kv_values


@pytest.mark.parametrize("n_cached,T", [(0, 300), (0, 10), (31, 40), (31, 1), (5, 3)])
def test_sparse_attention_one_gather_equals_attend_per_block(n_cached, T):
    # the one-buffer gather of window rows and picks vs `attend` per query block (window view + picks
    # gathered apart, joined at the seam): prefills from 0 (early windows rolled, a second query
    # block), a prompt shorter than the window, later chunks and a decode step, -1 picks
    g = torch.Generator().manual_seed(n_cached * 1000 + T)
    H, D, W, N, k = 4, 128, 32, 150, 64
    q = to_bf16(torch.randn(T, H, D, generator=g))
    keys = to_bf16(torch.randn(n_cached + T, D, generator=g))
    kv = to_bf16(torch.randn(N, D, generator=g))
    idx = torch.randint(0, N, (T, k), generator=g).sort(-1).values
    idx[torch.rand(T, k, generator=g) < 0.2] = -1
    sink = torch.linspace(-1, 1, H)
    fast = REF.sparse_attention(0, q, keys, n_cached, None, idx, _Source(kv), sink, W, D ** -0.5)
    plain = Fp32Ops.sparse_attention(REF, 0, q, keys, n_cached, None, idx, _Source(kv), sink, W, D ** -0.5)
    assert fast.shape == (T, H, D)
    assert torch.equal(fast, plain)
    # and the fp32 numerics' one softmax differs (the case exercises the reference's blocks)
    assert not torch.equal(fast, ops_for("fp32").sparse_attention(0, q, keys, n_cached, None, idx, _Source(kv), sink,
                                                                  W, D ** -0.5))


def test_mhc_sums_by_chunks_of_tokens_equal_whole_tensor_sums():
    # collapse and expand a chunk of tokens at a time vs the same fp32 terms over all tokens at once
    # (T = 300: two whole chunks and a tail), products added in the copies' order, rounded to bf16
    g = torch.Generator().manual_seed(3)
    T, hc, dim = 300, 4, 256
    x = to_bf16(torch.randn(T, hc, dim, generator=g))
    y = to_bf16(torch.randn(T, dim, generator=g))
    pre, post = torch.rand(T, hc, generator=g), 2 * torch.rand(T, hc, generator=g)
    comb = torch.rand(T, hc, hc, generator=g)
    collapsed = pre[:, 0, None] * x[:, 0]
    for i in range(1, hc):
        collapsed = collapsed + pre[:, i, None] * x[:, i]
    mixed = comb[:, 0, :, None] * x[:, 0, None, :]
    for i in range(1, hc):
        mixed = mixed + comb[:, i, :, None] * x[:, i, None, :]
    mixed = mixed + post.unsqueeze(-1) * y.unsqueeze(1)
    assert torch.equal(REF.collapse(x, pre), to_bf16(collapsed))
    assert torch.equal(REF.expand(y, x, post, comb), to_bf16(mixed))
    # the order of the adds matters at these values (a fused sum would differ somewhere)
    assert not torch.equal(to_bf16(torch.einsum("tij,tid->tjd", comb, x) + post.unsqueeze(-1) * y.unsqueeze(1)),
                           to_bf16(mixed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rounded_as_written_equals_rounding_the_rotated_copy(dtype):
    # rotate's output rounded to bf16 while it is written vs a float32 copy rotated then rounded;
    # fp32 inputs that are not bf16 values (the unrotated dims round too), and the input left untouched
    g = torch.Generator().manual_seed(7)
    T, H, D = 33, 4, 128
    freqs = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))  # 16 pairs: the last 32 dims rotate
    x = torch.randn(T, H, D, generator=g).to(dtype)
    before = x.clone()
    positions = torch.arange(100, 100 + T)
    ops = ops_for("reference")
    rd = freqs.numel() * 2
    for inverse in (False, True):
        cis = ops._rope_table(freqs, x.device)[positions].view(T, 1, rd // 2)
        cis = cis.conj() if inverse else cis
        plain = x.float().clone()
        plain[..., -rd:] = torch.view_as_real(torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2))
                                                                    .contiguous()) * cis).flatten(-2)
        got = ops.rotate(x, positions, freqs, inverse=inverse)
        assert got.dtype == torch.float32
        assert torch.equal(got, to_bf16(plain))
    assert torch.equal(x, before)


@pytest.mark.parametrize("n", [1024, 7])
def test_mean_square_by_chunks_of_rows_equals_the_whole_reduction(n):
    # the mHC mixes' RMS term a chunk of rows at a time vs one square().mean() over all rows (values
    # spread over 2^-10..2^10, so the order of the row's sum shows in the last bits)
    from engine.ops.reference import mean_square
    g = torch.Generator().manual_seed(n)
    x = torch.randn(300, n, generator=g) * 2.0 ** torch.randint(-10, 11, (300, n), generator=g).float()
    assert torch.equal(mean_square(x), x.square().mean(-1, keepdim=True))
    assert not torch.equal(mean_square(x), x.double().square().mean(-1, keepdim=True).float())
