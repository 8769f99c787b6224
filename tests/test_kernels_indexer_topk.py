"""The indexer's fused scoring + group maxima and the three-stage top-k (kernels/indexer.py, kernels/topk.py)
on the CPU interpreter, against float64 PyTorch references, including the paths the GPU's default shapes
do not take at these sizes (the radix fallback, tl.sort, groups wider than a tile)."""

import importlib
import os
import random

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

import kernels._formats
import kernels.topk
import kernels.indexer

for _m in (kernels._formats, kernels.topk, kernels.indexer):
    importlib.reload(_m)

from engine import quant as Q  # noqa: E402
from kernels import indexer, topk  # noqa: E402


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


def _ties(gen, rows, n):
    v = torch.randn(rows, n, generator=gen)
    v[0, ::3] = float("-inf")
    v[1, 10:400:3] = 1.5  # a run of exact ties around the top
    return v


@pytest.mark.parametrize("cap,sort", [(2048, False), (16, False), (64, True)])
def test_topk_stages_exact(gen, cap, sort):
    """cap 16 forces the radix fallback; sort=True runs the GPU's tl.sort path."""
    v = _ties(gen, 3, 500)
    lengths = torch.tensor([500, 450, 7], dtype=torch.int32)
    k = 32
    got = topk.topk_positions_triton(v, k, lengths, block=64, cap=cap, groups=64, sort=sort)
    assert torch.equal(got, topk.topk_positions_reference(v, k, lengths)), gen.initial_seed()
    assert (got[2, 7:] == -1).all()


def test_topk_wide_groups_and_all_ties(gen):
    """Groups wider than the tile, and a row of equal values: the earliest positions win."""
    v = torch.randn(2, 3000, generator=gen)
    v[1] = 0.0
    got = topk.topk_positions_triton(v, 16, block=32, groups=32)
    assert torch.equal(got, topk.topk_positions_reference(v, 16)), gen.initial_seed()
    assert torch.equal(got[1], torch.arange(16, dtype=torch.int32))


def test_fp4_to_e4m3_bytes_bit_assembly():
    """Every packed byte: the two E4M3 bytes are the E2M1 values times 2^-6 (via torch's float8 view)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(b_ptr, o_ptr):
        r = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
        b = tl.load(b_ptr + r)
        e = indexer._fp4_bytes_to_e4m3(b, False)
        tl.store(o_ptr + tl.arange(0, 16)[:, None] * 32 + tl.arange(0, 32)[None, :], e)

    b = torch.arange(256, dtype=torch.uint8)
    o = torch.zeros(512, dtype=torch.uint8)
    k[(1,)](b, o)
    want = Q.FP4_TABLE[torch.stack([b.long() & 15, b.long() >> 4], -1).flatten()] * 2.0 ** -6
    assert torch.equal(o.view(torch.float8_e4m3fn).float(), want.float())


def _inputs(gen, t, h, d, n, pool, spread=4):
    """FP4 queries and keys whose 32-groups differ in scale by up to 2^(2 * spread)."""
    def draw(*shape):
        e = torch.randint(-spread, spread + 1, (*shape[:-1], shape[-1] // 32, 1), generator=gen)
        x = torch.randn(*shape, generator=gen) * (2.0 ** e.float()).expand(*shape[:-1], shape[-1] // 32, 32).flatten(-2)
        return Q.quantize_fp4(x, 32)
    q, k = draw(t, h, d), draw(n, d)
    w = torch.randn(t, h, generator=gen)
    nv = torch.randint(0, n + 1, (t,), generator=gen, dtype=torch.int32)
    nv[0] = n
    pm = (torch.rand(t, -(-n // 8), generator=gen) > 0.3) if pool else None
    return (*q, *k, w, nv, pm)


@pytest.mark.parametrize("t,h,d,n,pool,tune", [
    (1, 4, 64, 300, True, {}),
    (2, 8, 128, 700, False, {"block_n": 16, "groups": 8}),  # maxima over groups of several tiles
    (18, 2, 32, 250, True, {"block_t": 8, "chunk": 64}),
])
def test_indexer_fused_scores_and_topk(gen, t, h, d, n, pool, tune):
    args = _inputs(gen, t, h, d, n, pool)
    want = indexer.indexer_scores_reference(*args)
    got = indexer.indexer_scores_triton(*args, **{a: b for a, b in tune.items() if a != "groups"})
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), gen.initial_seed()
    assert ((want[fin] - got[fin]).norm() / want[fin].norm()) < 1e-6, gen.initial_seed()
    sel = indexer.indexer_topk_triton(*args, topk=16, **tune)
    # the kernel's own fp32 scores ranked by the reference rule: the same positions, order and -1 padding
    assert torch.equal(sel, topk.topk_positions_reference(got, 16)), gen.initial_seed()
    ref = indexer.indexer_topk_reference(*args, topk=16)
    assert torch.equal((sel >= 0).sum(1), (ref >= 0).sum(1)), gen.initial_seed()
