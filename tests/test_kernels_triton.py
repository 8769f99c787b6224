"""Every Triton kernel against its PyTorch reference, on the CPU under TRITON_INTERPRET=1 (tiny shapes).

Inputs are fresh random draws each run (the seed is in the failure message); outputs the kernels
allocate are poisoned (NaN / sentinel bytes) so an unwritten element fails the comparison.
"""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

from engine import quant as Q
from tests.test_kernels_mhc import _inputs as mhc_inputs

_, quant, _, _, topk, indexer, sparse_attn, _, moe, mhc, fp8_linear, dispatch = interpreted(
    "_formats", "quant", "topk_search", "topk_split", "topk", "indexer", "sparse_attn", "fp4_tiles", "moe", "mhc",
    "fp8_linear", "dispatch")


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(b).any(), "NaN in the kernel's output (unwritten or invalid)"
    return ((a - b).norm() / a.norm()).item()


# -- quantizers: byte for byte ------------------------------------------------------------------

@pytest.mark.parametrize("block,kind", [(32, "e8m0"), (16, "e4m3")])
def test_fp4_quantizer_bit_exact(poisoned, gen, block, kind):
    x = torch.randn(9, 256, generator=gen) * torch.logspace(-6, 3, 9)[:, None]
    x[0, :block] = 0  # all-zero group keeps a finite scale
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75] * 2)  # ties at E2M1 midpoints
    x = x.to(torch.bfloat16)
    (qa, sa), (qb, sb) = quant.quantize_fp4_reference(x, block, kind), quant.quantize_fp4_triton(x, block, kind)
    assert sb.dtype == sa.dtype and qb.dtype == qa.dtype, gen.initial_seed()
    assert torch.equal(qa, qb), gen.initial_seed()
    assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8)), gen.initial_seed()
    # with the values loading the bytes gives back (the compressor's entries): engine.quant's, bit for bit
    qv, sv, vv = quant.quantize_fp4_triton(x, block, kind, values=True)
    want = Q.quantize_fp4_with_values(x, block, kind)
    assert torch.equal(qv, qa) and torch.equal(sv.view(torch.uint8), sa.view(torch.uint8))
    assert vv.dtype == torch.float32 and torch.equal(vv, want[2]), gen.initial_seed()
    assert torch.equal(vv, Q.dequantize_fp4(qa, sa, block))


def test_fp8_quantizer_bit_exact(poisoned, gen):
    x = torch.randn(7, 512, generator=gen) * torch.logspace(-8, 4, 7)[:, None]
    x[0, :32] = 0
    x[1, 32], x[1, 33:64] = 1.0, -1e-12  # negatives that round to -0 (the sign of zero kept, as torch's cast does)
    (qa, sa), (qb, sb) = quant.quantize_fp8_reference(x, 32), quant.quantize_fp8_triton(x, 32)
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)), gen.initial_seed()
    assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8)), gen.initial_seed()
    # the round trip in one launch: the dequantized bytes, bit for bit, and so the engine's fp8_roundtrip
    rt = quant.fp8_roundtrip_triton(x.view(7, 4, 128), 32)
    assert rt.shape == (7, 4, 128) and torch.equal(rt.view(7, 512), Q.dequantize_fp8(qa, sa, 32))
    assert torch.equal(rt.view(7, 512).view(torch.int32), Q.dequantize_fp8(qa, sa, 32).view(torch.int32))  # bits
    assert torch.equal(rt, Q.fp8_roundtrip(x.view(7, 4, 128), 32))
    # stored bf16 (the routed experts' input): the same values, none rounded (an E4M3 value times a power of two
    # is a bf16), across the rows' 12 decades; and from a bf16 input, as from its float32 widening
    narrow = quant.fp8_roundtrip_triton(x.view(7, 4, 128), 32, bf16_out=True)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), rt)
    assert torch.equal(quant.fp8_roundtrip_reference(x.view(7, 4, 128), 32, bf16_out=True), narrow)
    xb = x.bfloat16()
    assert torch.equal(quant.fp8_roundtrip_triton(xb, 32), Q.fp8_roundtrip(xb.float(), 32))
    # in the FP4 decoders' nibble order (the MoE's grouped GEMM input): position 2 A + h of each 8-group holds
    # value A + 4 h, written out by hand here, not through fp4_tiles.nib_order
    nib = quant.fp8_roundtrip_triton(x, 32, bf16_out=True, nib=True)
    by_hand = torch.stack([narrow.view(7, 512)[:, g + a + 4 * h] for g in range(0, 512, 8) for a in range(4)
                           for h in range(2)], dim=1)
    assert torch.equal(nib, by_hand) and not torch.equal(nib, narrow.view(7, 512))
    assert torch.equal(quant.fp8_roundtrip_reference(x, 32, bf16_out=True, nib=True), nib)
    # then in the register-operand experts' MMA order (moe_rs.rs_position inside each 64 columns), in the same
    # launch; over a partial last tile of groups too (9 rows: 144 groups, tiles of 64)
    from kernels.moe_rs import rs_position
    for rows in (x, torch.cat([x, x[:2] * 3])):
        nib_rows = quant.fp8_roundtrip_triton(rows, 32, bf16_out=True, nib=True)
        rs = quant.fp8_roundtrip_triton(rows, 32, bf16_out=True, nib=True, rs=True)
        by_position = torch.stack([nib_rows[:, b + rs_position(m)] for b in range(0, 512, 64) for m in range(64)], 1)
        assert torch.equal(rs, by_position) and not torch.equal(rs, nib_rows)
        assert torch.equal(quant.fp8_roundtrip_reference(rows, 32, bf16_out=True, nib=True, rs=True), rs)
    for bad in (dict(nib=False), dict(block=16)):
        with pytest.raises(ValueError, match="MMA order"):
            quant.fp8_roundtrip_triton(x, bad.get("block", 32), bf16_out=True, nib=bad.get("nib", True), rs=True)
    with pytest.raises(ValueError, match="whole 64s"):
        quant.fp8_roundtrip_triton(x[:, :480], 32, bf16_out=True, nib=True, rs=True)


# -- top-k ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,length,k,chunk,bits", [(3, 700, 32, None, 8), (2, 1500, 64, 256, 4)])
def test_topk_positions_exact(poisoned, gen, rows, length, k, chunk, bits):
    v = torch.randn(rows, length, generator=gen)
    v[0, ::3] = float("-inf")
    v[1, 40:90] = 0.25  # a block of ties straddling the threshold region
    v[1, 300:340] = 0.25
    lengths = torch.randint(1, length, (rows,), generator=gen, dtype=torch.int32)
    lengths[-1] = 5  # fewer visible than k: -1 padding
    want = topk.topk_positions_reference(v, k, lengths)
    got = topk.topk_positions_triton(v, k, lengths, chunk=chunk, block=128, bits=bits)
    assert torch.equal(want, got), gen.initial_seed()
    assert (got[-1, 5:] == -1).all() and (got[-1, :5] == torch.arange(5)).all()


# -- indexer -------------------------------------------------------------------------------------

def _indexer_inputs(gen, t, h=4, d=64, n=200, pool=True):
    q = Q.quantize_fp4(torch.randn(t, h, d, generator=gen), 32)
    k = Q.quantize_fp4(torch.randn(n, d, generator=gen), 32)
    w = torch.randn(t, h, generator=gen)
    nv = torch.randint(0, n + 1, (t,), generator=gen, dtype=torch.int32)
    nv[0] = n
    pm = (torch.rand(t, -(-n // 8), generator=gen) > 0.3) if pool else None
    return (*q, *k, w, nv, pm)


@pytest.mark.parametrize("t", [1, 20])  # decode (one query) and a prefill tile
def test_indexer_scores_and_topk(poisoned, gen, t):
    args = _indexer_inputs(gen, t, pool=t == 1)
    want = indexer.indexer_scores_reference(*args)
    got = indexer.indexer_scores_triton(*args)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), gen.initial_seed()
    assert _rel(want[fin], got[fin]) < 1e-5, gen.initial_seed()
    sel = indexer.indexer_topk_triton(*args, topk=16)
    ref = indexer.indexer_topk_reference(*args, topk=16)
    # same choice up to exact ties of the float64 scores
    for r in range(t):
        a, b = ref[r][ref[r] >= 0], sel[r][sel[r] >= 0]
        assert a.numel() == b.numel() and (b.diff() > 0).all(), gen.initial_seed()
        if not torch.equal(a, b):
            assert torch.allclose(want[r, a.long()].sort().values, want[r, b.long()].sort().values), gen.initial_seed()


# -- sparse attention ----------------------------------------------------------------------------

@pytest.mark.parametrize("t", [2, 5])
def test_sparse_attn(poisoned, gen, t):
    h, d, n, w, k, wn = 16, 64, 60, 24, 40, 8
    q = (torch.randn(t, h, d, generator=gen) * 2).to(torch.bfloat16)
    kvp, kvs = Q.quantize_fp4(torch.randn(n, d, generator=gen), 16, "e4m3")
    w8, ws = Q.quantize_fp8(torch.randn(w, d, generator=gen))
    idx = torch.randint(-1, n, (t, k), generator=gen, dtype=torch.int32)
    widx = torch.randint(-1, w, (t, wn), generator=gen, dtype=torch.int32)
    idx[-1], widx[-1] = -1, -1  # nothing selected: zeros
    sink = torch.randn(h, generator=gen)
    args = (q, kvp, kvs, idx, w8, ws, widx, sink)
    want = sparse_attn.sparse_attn_reference(*args)
    got = sparse_attn.sparse_attn_triton(*args, block_n=16)
    assert _rel(want, got) < 1e-2, gen.initial_seed()  # bf16 output (the interpreter truncates to bf16)
    assert (got[-1] == 0).all()


# -- MoE -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,block_m", [(1, 16), (9, 16)])
def test_moe_fp4(poisoned, gen, t, block_m):
    e, inter, dim, k = 6, 64, 128, 3
    wq = lambda o, i: Q.quantize_fp4(torch.randn(e, o, i, generator=gen), 32)
    w1, s1 = wq(inter, dim)
    w3, s3 = wq(inter, dim)
    w2, s2 = wq(dim, inter)
    x = (torch.randn(t, dim, generator=gen)).to(torch.bfloat16)  # large enough to hit the clamps
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    tw = torch.rand(t, k, generator=gen)
    args = (x, w1, s1, w3, s3, w2, s2, ids, tw)
    want = moe.moe_fp4_reference(*args)
    got = moe.moe_fp4_triton(*args, block_m=block_m, block_n=32, block_k=64)
    assert _rel(want, got) < 1e-4, gen.initial_seed()


def test_moe_swiglu_clamps_are_active(gen):
    """The clamp must matter at these scales, or the MoE test could not catch a missing clamp."""
    e, inter, dim = 6, 64, 128
    w1, s1 = Q.quantize_fp4(torch.randn(e, inter, dim, generator=gen), 32)
    x = torch.randn(4, dim, generator=gen).to(torch.bfloat16)
    g = x.double() @ Q.dequantize_fp4(w1[0], s1[0], 32).double().T
    assert (g.abs() > 10).any()


# -- mHC -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,with_post", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_mhc(poisoned, gen, dtype, with_post):
    t = 5
    x, fn, scale, base, pre_prev, *extra = mhc_inputs(gen, t, 64, dtype, with_post)
    want = mhc.mhc_reference(x, fn, scale, base, pre_prev, *extra)
    got = mhc.mhc_triton(x, fn, scale, base, pre_prev, *extra, block_d=32)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(want, got):
        assert (a is None) == (b is None)
        if a is not None:
            assert _rel(a, b) < tol, gen.initial_seed()
    # the Sinkhorn output is doubly stochastic to within the eps terms
    comb = got[4]
    assert torch.allclose(comb.sum(-2), torch.ones(t, 4), atol=1e-4)


# -- FP8 linear ----------------------------------------------------------------------------------

def test_fp8_linear(poisoned, gen):
    x = torch.randn(70, 96, generator=gen).to(torch.bfloat16)
    w, ws = Q.quantize_fp8_weight(torch.randn(100, 96, generator=gen))
    want = fp8_linear.fp8_linear_reference(x, w, ws)
    got = fp8_linear.fp8_linear_triton(x, w, ws, block_m=64, block_n=32)
    assert _rel(want, got) < 1e-2, gen.initial_seed()


@pytest.mark.parametrize("m,split_k", [(5, None), (5, 3), (64, 7), (1, 1)])
def test_fp8_linear_split_k_matches_the_whole_k_sum(poisoned, gen, m, split_k):
    """Decode-sized products split K (float32 partials added in split order): the reference's values,
    and the unsplit kernel's to within one bf16 rounding of the output."""
    x = torch.randn(m, 320, generator=gen).to(torch.bfloat16)
    w, ws = Q.quantize_fp8_weight(torch.randn(100, 320, generator=gen))
    want = fp8_linear.fp8_linear_reference(x, w, ws)
    whole = fp8_linear.fp8_linear_triton(x, w, ws, split_k=1)
    got = fp8_linear.fp8_linear_triton(x, w, ws, split_k=split_k)
    assert _rel(want, got) < 1e-2, gen.initial_seed()
    # one bf16 rounding apart (2^-7 relative), or float32 summation order apart where the value nearly cancels
    tiny = 1e-5 * whole.float().abs().max().item()
    assert torch.allclose(got.float(), whole.float(), rtol=2.0 ** -7, atol=tiny), gen.initial_seed()
    # float_out: the same bf16 values as float32, rounded to nearest even in the kernel (split or not)
    for splits in (1, split_k):
        fo = fp8_linear.fp8_linear_triton(x, w, ws, split_k=splits, float_out=True)
        part = fp8_linear.fp8_linear_triton(x, w, ws, split_k=splits)
        assert fo.dtype == torch.float32 and torch.equal(fo.bfloat16().float(), fo)
        assert ((fo - part.float()).abs() <= 2.0 ** -7 * fo.abs()).all()  # one step: the interpreter truncates
    assert fp8_linear.fp8_linear_reference(x, w, ws, float_out=True).dtype == torch.float32


@pytest.mark.parametrize("m,n,k", [(64, 5120, 8192), (64, 1280, 5120), (1, 512, 5120), (64, 32768, 1280),
                                   (4096, 5120, 8192)])
def test_fp8_linear_plan_fills_the_gpu_at_decode_and_covers_every_k_step(m, n, k):
    bm, bn, steps, splits = fp8_linear.fp8_linear_plan(m, n, k, "cpu")  # the H200's 132 SMs off the GPU
    ks = k // 32
    assert steps * splits >= ks > steps * (splits - 1)  # every K step in exactly one split, none empty
    programs = -(-m // bm) * -(-n // bn) * splits
    if m <= 64:
        assert (bm, bn) == (64, 128)
        assert programs >= 132 or splits == ks  # a full wave, unless K cannot be cut finer
        assert programs <= 4 * 132 or splits == 1
    else:
        assert splits == 1 and (bm, bn) == (128, 128)


# -- dispatch ------------------------------------------------------------------------------------

def test_dispatch_uses_reference_on_cpu_and_compare_reports(gen):
    assert dispatch.use_triton("cpu") is False
    x = torch.randn(4, 64, generator=gen)
    assert torch.equal(dispatch.quantize_fp4(x, 16, "e4m3")[0], Q.quantize_fp4(x, 16, "e4m3")[0])
    rep = dispatch.compare("quantize_fp4", x, 16, "e4m3")
    assert rep["max_abs"] == 0 and rep["mismatched_bytes"] == 0
    v = torch.randn(2, 300, generator=gen)
    assert dispatch.compare("topk_positions", v, 16)["mismatched_bytes"] == 0
    with pytest.raises(ValueError, match="unknown kernel"):
        dispatch.compare("nope")
