"""The indexer's key fold (kernels/indexer.py `_key_folded`, key_fold=True): each key's group exponents
moved into its E4M3 operand, one K = D dot per tile, the key's common factor after the head sum. On the
CPU interpreter (an exact-product float32 dot) against float64: exact while every key's and query's
group exponents span <= 14 (the E4M3 subnormals included), rounded to the E4M3 grid beyond, and the
same scores as the default four-dot form. The H200's FP8 MMA adds chained K = 32 blocks at 13 mantissa
bits, which is why the fold is a knob, off by default (the module's docstring has the measurement)."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

from engine import quant as Q

_, _, _, _, indexer = interpreted("_formats", "topk_search", "topk_split", "topk", "indexer")


def _pack(codes):
    """E2M1 codes (0..15) [..., K] -> packed int8 [..., K/2], low nibble first."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def _e8m0(exponents):
    return exponents.to(torch.uint8).view(torch.float8_e8m0fnu)


def _folded(packed, scale):
    """float64 values of the fold's operands times their factor: RN_E4M3(value * 2^(6 - s)) * 2^(max - 133)
    per 32-group, s = the row's max group exponent - the group's (torch's float8 cast rounds to nearest even)."""
    v = Q.unpack_fp4(packed).unflatten(-1, (-1, 32))
    e = scale.view(torch.uint8).long()
    top = e.amax(-1, keepdim=True)
    op = (v * torch.exp2((6 - (top - e)).float())[..., None]).to(torch.float8_e4m3fn).double()
    return (op * torch.exp2((top - 133).double())[..., None]).flatten(-2)


def _exact(packed, scale):
    return Q.dequantize_fp4(packed, scale, 32).double()


def _relu_sum(q, k, w):
    """float64 [T, N]: sum_h w[t, h] relu(q[t, h] . k[n])."""
    return torch.einsum("thn,th->tn", torch.einsum("thd,nd->thn", q, k).clamp_min(0), w.double())


def _fp32_bound(q, k, w):
    """Rounding of the kernel's float32 arithmetic on exact products: each of the D + H + 8 additions and
    multiplications on the way to a score errs by at most 2^-24 of the sum of |terms|."""
    d, h = k.shape[1], w.shape[1]
    return (d + h + 8) * 2.0**-24 * torch.einsum("thn,th->tn", torch.einsum("thd,nd->thn", q.abs(), k.abs()),
                                                 w.double().abs())


def _shifted_rows(gen, rows, d, shifts):
    """FP4 rows [rows, d] with random codes; group 0 holds the row's max exponent (random in 100..150),
    group g sits shifts[:, g - 1] below it; about one group in eight is all zero codes."""
    ng = d // 32
    top = torch.randint(100, 151, (rows, 1), generator=gen)
    e = top - torch.cat([torch.zeros(rows, 1, dtype=torch.long), shifts], 1)
    codes = torch.randint(0, 16, (rows, ng, 32), generator=gen)
    codes[torch.rand(rows, ng, generator=gen) < 0.125] = 0
    return _pack(codes.flatten(1)), _e8m0(e)


def _probe_inputs(gen, t, h, d, n, pick):
    """Queries whose group 0 is all zero at their max exponent and keys whose group 0 holds theirs: the
    scores come from groups 1.. alone, whose shifts are drawn from `pick` (so nothing larger hides them)."""
    ng = d // 32

    def shifts(rows):
        return pick[torch.randint(0, len(pick), (rows, ng - 1), generator=gen)]
    kp, ks = _shifted_rows(gen, n, d, shifts(n))
    qp, qs = _shifted_rows(gen, t * h, d, shifts(t * h))
    qc = qp.view(torch.uint8).view(t * h, ng, 16).clone()
    qc[:, 0] = 0
    w = torch.randn(t, h, generator=gen)
    nv = torch.full((t,), n, dtype=torch.int32)
    return qc.view(torch.int8).view(t, h, d // 2), qs.view(t, h, ng), kp, ks, w, nv


def test_key_fold_operand_every_code_and_shift():
    """_key_folded's operand for all 16 codes at shifts 0..22 is torch's round-to-nearest-even E4M3 of
    value * 2^(6 - s) (exact to s = 14, 0 from s = 19), and the key factor is 2^(max exponent - 133)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(b_ptr, s_ptr, o_ptr, f_ptr):
        r = tl.arange(0, 32)
        b = tl.load(b_ptr + r[:, None] * 32 + tl.arange(0, 32)[None, :])
        sc = tl.load(s_ptr + r[:, None] * 2 + tl.arange(0, 2)[None, :]).to(tl.int32)
        op, kf = indexer._key_folded(b, sc, False, False)
        tl.store(o_ptr + r[:, None] * 64 + tl.arange(0, 64)[None, :], op)
        tl.store(f_ptr + r, kf)

    shift = torch.arange(32).clamp_max(22)
    codes = torch.arange(64) % 16
    b = _pack(codes.expand(32, 64))
    top = 120 + torch.arange(32) % 5
    sc = torch.stack([top, top - shift], 1).to(torch.uint8)
    o, f = torch.zeros(32, 64), torch.zeros(32)
    k[(1,)](b, sc, o, f)
    fp4 = Q.FP4_TABLE[codes]
    want = (fp4 * torch.exp2(6.0 - torch.cat([torch.zeros(32, 1), shift[:, None].expand(32, 1)], 1)
                             .repeat_interleave(32, 1))).to(torch.float8_e4m3fn).float()
    assert torch.equal(o, want)
    assert torch.equal(o[:15, 32:], fp4[32:] * torch.exp2(6.0 - shift[:15, None]))  # exact to s = 14
    assert (o[19:, 32:] == 0).all() and (o[18, 32:] != 0).any()
    assert torch.equal(f, torch.exp2(top.float() - 133))


@pytest.mark.parametrize("t,d", [(18, 128), (3, 128), (18, 64)])  # prefill tiles; decode (prefetch loop)
def test_folded_scores_exact_to_span_14(gen, t, d):
    """Scores made only of groups shifted 12..14 below their row's max (E4M3 subnormal operands, code 1
    at s = 14 is the least one, 2^-9) or by any other shift <= 14, zero groups among them: equal to the
    float64 reference to the existing tests' 1e-6 and, entry by entry, to float32 rounding."""
    args = _probe_inputs(gen, t, 4, d, 160, torch.tensor([12, 13, 14, 12, 13, 14, 0, 7]))
    q, k = _exact(*args[:2]), _exact(*args[2:4])
    assert torch.equal(_folded(*args[:2]), q) and torch.equal(_folded(*args[2:4]), k)  # spans <= 14: no rounding
    want = indexer.indexer_scores_reference(*args)
    got = indexer.indexer_scores_triton(*args, key_fold=True)
    assert torch.isfinite(got).all() and want.abs().max() > 0
    assert ((want - got).norm() / want.norm()) < 1e-6, gen.initial_seed()
    bound = _fp32_bound(q, k, args[4])
    assert ((got.double() - _relu_sum(q, k, args[4])).abs() <= bound).all(), gen.initial_seed()


@pytest.mark.parametrize("t,d,tune", [
    (18, 128, {}), (3, 128, {"block_n": 32}), (18, 64, {"block_t": 8}), (5, 32, {"pool": True}),
    (2, 128, {"prefetch_keys": False}),
])
def test_folded_equals_four_dot_form(gen, t, d, tune):
    """The fold and the four-dot form (the default) on random keys and queries (group scales 2^-8..2^8
    apart): the same scores to float32 rounding, -inf at the same masked entries."""
    tune = dict(tune)
    h, n = 4, 300

    def draw(*shape):
        e = torch.randint(-4, 5, (*shape[:-1], shape[-1] // 32, 1), generator=gen).float()
        x = torch.randn(*shape, generator=gen).unflatten(-1, (-1, 32)) * torch.exp2(e)
        return Q.quantize_fp4(x.flatten(-2), 32)
    (qp, qs), (kp, ks) = draw(t, h, d), draw(n, d)
    w = torch.randn(t, h, generator=gen)
    nv = torch.randint(1, n + 1, (t,), generator=gen, dtype=torch.int32)
    pm = (torch.rand(t, -(-n // 8), generator=gen) > 0.3) if tune.pop("pool", False) else None
    args = (qp, qs, kp, ks, w, nv, pm)
    fold = indexer.indexer_scores_triton(*args, key_fold=True, **tune)
    four = indexer.indexer_scores_triton(*args, **tune)
    fin = torch.isfinite(four)
    assert torch.equal(fin, torch.isfinite(fold)) and fin.any() and not fin.all(), gen.initial_seed()
    bound = 2 * _fp32_bound(_exact(qp, qs), _exact(kp, ks), w)
    assert ((fold - four).double().abs()[fin] <= bound[fin]).all(), gen.initial_seed()


@pytest.mark.parametrize("t", [18, 3])
def test_folded_beyond_span_14_rounds_to_e4m3(gen, t):
    """Groups 15..20 below their row's max (queries and keys): their operands round to nearest even on
    E4M3's 2^-9 grid (all 0 from 19), as `_folded` models; the scores then equal the model's to float32
    rounding and differ from the exact float64 reference by at most the rounding's bound, half a grid
    step per rounded element: sum_h |w| sum_i (|dq_i| |k_i| + |q_i| |dk_i| + |dq_i dk_i|)."""
    d, h = 128, 4
    args = _probe_inputs(gen, t, h, d, 160, torch.tensor([15, 16, 17, 18, 19, 20, 14, 3]))
    q, k = _exact(*args[:2]), _exact(*args[2:4])
    qr, kr = _folded(*args[:2]), _folded(*args[2:4])
    got = indexer.indexer_scores_triton(*args, key_fold=True).double()
    w = args[4]
    assert ((got - _relu_sum(qr, kr, w)).abs() <= _fp32_bound(qr, kr, w)).all(), gen.initial_seed()

    def half_step(packed, scale):  # 2^-10 of the operand's scale where a group is shifted by > 14
        e = scale.view(torch.uint8).long()
        top = e.amax(-1, keepdim=True)
        return torch.where(top - e > 14, torch.exp2((top - 143).double()), 0.0).repeat_interleave(32, -1)
    dq, dk = half_step(*args[:2]).reshape(q.shape), half_step(*args[2:4])
    assert ((qr - q).abs() <= dq).all() and ((kr - k).abs() <= dk).all()
    err = (torch.einsum("thd,nd->thn", dq, k.abs()) + torch.einsum("thd,nd->thn", q.abs(), dk)
           + torch.einsum("thd,nd->thn", dq, dk))
    bound = torch.einsum("thn,th->tn", err, w.double().abs()) + _fp32_bound(qr, kr, w)
    exact = _relu_sum(q, k, w)
    assert ((got - exact).abs() <= bound).all(), gen.initial_seed()
    # the data makes the rounding matter: the exact scores are out of the model's float32 reach
    assert ((_relu_sum(qr, kr, w) - exact).abs() > _fp32_bound(qr, kr, w)).any(), gen.initial_seed()
