"""The FP4 MoE's MMA K order (kernels/fp4_tiles.py `fp4_words_mma`, `in_mma_k_order`, `mma_order`,
`mma_position`; kernels/moe.py a_layout="mma") on the CPU under TRITON_INTERPRET=1: the order is a
permutation that the weight decode, x's host permutation and h's store all agree on, and the grouped GEMM
in it gives the reference's values."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch
import triton
import triton.language as tl

from engine import quant as Q

_, fp4_tiles, moe = interpreted("_formats", "fp4_tiles", "moe")


@triton.jit
def _positions_kernel(out_ptr, K: tl.constexpr):
    n = tl.arange(0, K)
    tl.store(out_ptr + n, fp4_tiles.mma_position(n))


def _positions(k):
    out = torch.empty(k, dtype=torch.int32)
    _positions_kernel[(1,)](out, K=k)
    return out.long()


def test_mma_order_is_a_permutation_and_position_agrees():
    """mma_order (x on the host) and mma_position (h's store in the gate/up kernel) are the same
    permutation: entry n lands at mma_position(n); within each 64 block, and inverted by a scatter."""
    k = 256
    a = torch.arange(k, dtype=torch.float64).reshape(1, k) + 1000 * torch.arange(3.0, dtype=torch.float64)[:, None]
    perm = fp4_tiles.mma_order(a)
    assert torch.equal(perm.sort(dim=1).values, a)  # a permutation of each row
    pos = _positions(k)
    assert torch.equal(pos.sort().values, torch.arange(k))
    assert torch.equal((pos // 64), torch.arange(k) // 64)  # inside each 64 block
    assert torch.equal(perm[:, pos], a)  # entry n at mma_position(n)
    back = torch.empty_like(perm)
    back[:, pos] = perm[:, pos]
    assert torch.equal(back, perm)
    # the relabelling on top of NIB: NIB column 16 c + 4 s + 2 h + t at 16 s + 8 h + 2 c + t
    nib = fp4_tiles.nib_order(a)
    m = torch.arange(64)
    dst = ((m >> 2) & 3) * 16 + ((m >> 1) & 1) * 8 + (m >> 4) * 2 + (m & 1)
    assert torch.equal(perm[:, dst], nib[:, :64])


@pytest.mark.parametrize("block_k", [64, 128])
def test_mma_tile_decode_every_byte_and_scale(block_k):
    """The MMA form's loads (`fp4_words_mma`: each thread's wgmma A fragment) and decode, for every FP4 byte
    under every scale byte up to 2^113 (the float32 form's range, as tests/test_kernels_moe.py's NIB check):
    engine.quant's decode in MMA order."""
    rows, kdim = 256, 512
    packed = torch.arange(256, dtype=torch.int32).repeat(rows, 1).to(torch.uint8).view(torch.int8)
    # each row's bytes shifted by 7 x its index, so that rows and K blocks differ
    packed = (packed.view(torch.uint8).long() + torch.arange(rows)[:, None] * 7) % 256
    packed = packed.to(torch.uint8).view(torch.int8)
    scale = ((torch.arange(rows)[:, None] + torch.arange(kdim // 32)[None, :]) % 241).to(torch.uint8)
    scale = scale.contiguous().view(torch.float8_e8m0fnu)
    want = fp4_tiles.mma_order(Q.dequantize_fp4(packed, scale, 32))
    got = fp4_tiles.fp4_tile_decoded(packed, scale, False, mma=True, block_k=block_k)
    assert torch.equal(got, want)
    # the NIB form's decode of the same bytes, relabelled
    nib = fp4_tiles.fp4_tile_decoded(packed, scale, False)
    m = torch.arange(kdim) % 64
    dst = (torch.arange(kdim) // 64) * 64 + ((m >> 2) & 3) * 16 + ((m >> 1) & 1) * 8 + (m >> 4) * 2 + (m & 1)
    assert torch.equal(got[:, dst], nib)


def _case(gen, t, e=4, inter=128, dim=256, k=2):
    wq = lambda o, i: Q.quantize_fp4(torch.randn(e, o, i, generator=gen), 32)
    w1, s1 = wq(inter, dim)
    w3, s3 = wq(inter, dim)
    w2, s2 = wq(dim, inter)
    # every FP4 byte and scale bytes down to 2^-127 in w1
    w1 = torch.arange(256, dtype=torch.int32).repeat(w1.numel() // 256 + 1)[: w1.numel()].reshape(w1.shape)
    w1 = w1.to(torch.uint8).view(torch.int8)
    s1 = (s1.view(torch.uint8).long() - torch.randint(0, 3, s1.shape, generator=gen)).clamp(0, 254)
    s1 = s1.to(torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.randn(t, dim, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    return x, w1, s1, w3, s3, w2, s2, ids, torch.rand(t, k, generator=gen)


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(b).any()
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 64, 64), (16, 128, 128), (32, 64, 128)])
def test_grouped_path_mma_layout(gen, block_m, block_n, block_k):
    """a_layout="mma": the reference's values, and the NIB form's up to the order of float32 sums (x, h and
    the weights all in MMA order; several N blocks so that the row offsets and masks of `fp4_words_mma`
    matter: I 128 at block_n 64 / 128, dim 256)."""
    args = _case(gen, 13)
    knobs = dict(gemv_max_pairs=0, block_m=block_m, block_n=block_n, block_k=block_k)
    got = moe.moe_fp4_triton(*args, a_layout="mma", **knobs)
    nib = moe.moe_fp4_triton(*args, **knobs)
    assert _rel(moe.moe_fp4_reference(*args), got) < 1e-5, gen.initial_seed()
    assert _rel(nib, got) < 1e-6, gen.initial_seed()


def test_grouped_path_mma_partial_row_block(gen):
    """I 192 with 128-row blocks: the second N block has 64 valid rows of 128 (fp4_words_mma's row mask)."""
    args = _case(gen, 9, inter=192)
    got = moe.moe_fp4_triton(*args, a_layout="mma", gemv_max_pairs=0, block_m=16, block_n=128, block_k=64)
    assert _rel(moe.moe_fp4_reference(*args), got) < 1e-5, gen.initial_seed()


def test_mma_layout_refuses_partial_blocks():
    args = _case(torch.Generator().manual_seed(0), 9)
    with pytest.raises(ValueError, match="multiples of 64"):
        moe.moe_fp4_triton(*args, a_layout="mma", gemv_max_pairs=0, block_m=16, block_n=32)
    with pytest.raises(ValueError, match="a_layout"):
        moe.moe_fp4_triton(*args, a_layout="kmajor", gemv_max_pairs=0)
