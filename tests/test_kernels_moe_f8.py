"""The FP4 experts on FP8 tensor cores (kernels/moe_f8.py) on the CPU under TRITON_INTERPRET=1: the E2M1 ->
E4M3 bit placement for every byte, the HALVES K order, and the whole grouped path against its float64
reference and against engine/model/moe.py's routed experts with the reference numerics."""

from interpreted import interpreted  # first: the interpreter before triton

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from engine import quant as Q
from engine.model.moe import routed_experts
from engine.ops.reference import ReferenceOps
from moe_checks import close_but_one_token
from test_kernels_moe import _case, _rel

_formats, fp4_tiles, moe_f8, _, moe = interpreted("_formats", "fp4_tiles", "moe_f8", "moe_gemv", "moe")


@triton.jit
def _placed_kernel(b_ptr, lo_ptr, hi_ptr):
    b = tl.load(b_ptr + tl.arange(0, 256))
    lo, hi = _formats.e2m1_as_e4m3(b, False)
    tl.store(lo_ptr + tl.arange(0, 256), lo)
    tl.store(hi_ptr + tl.arange(0, 256), hi)


@triton.jit
def _e4m3_kernel(x_ptr, rounded_ptr, via_code_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x_ptr + i, mask=m, other=0.0)
    tl.store(rounded_ptr + i, _formats.e4m3_rounded(v), mask=m)
    tl.store(via_code_ptr + i, _formats.e4m3_value(_formats.e4m3_code(v)), mask=m)


def test_e4m3_rounding_on_the_float_bits_is_torchs_cast():
    """_formats.e4m3_rounded (the bf16 form's hidden state, no byte made): every E4M3 value, every midpoint and
    the floats either side of it, the subnormal / normal boundary, and 400K random floats within +-448, equal to
    torch's float8_e4m3fn cast bit for bit (the sign of zero included) and in value to the code's round trip."""
    gen = torch.Generator().manual_seed(448)
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    rnd = torch.randint(-2**31, 2**31 - 1, (400_000,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([vals, near, -near, rnd, torch.tensor([2.0**-6, 2.0**-7, 2.0**-10, -2.0**-11, 0.0, -0.0])])
    x = x[torch.isfinite(x) & (x.abs() <= 448)].contiguous()
    rounded, via_code = torch.empty_like(x), torch.empty_like(x)
    _e4m3_kernel[(triton.cdiv(x.numel(), 4096),)](x, rounded, via_code, x.numel(), BLOCK=4096)
    assert torch.equal(rounded.view(torch.int32), x.to(torch.float8_e4m3fn).float().view(torch.int32))
    assert torch.equal(rounded, via_code)  # the code's round trip: the same values (its zeros carry no sign)
    assert (rounded != x).float().mean() > 0.5  # most of them do round


def test_every_fp4_byte_placed_as_e4m3():
    """Both nibbles of all 256 bytes: the E4M3 byte's value (read by torch's own float8_e4m3fn) is the E2M1
    value times 2^-6, sign included (zero, -0, the subnormal 0.5 on E4M3's subnormal 2^-7, and 6), so the
    weight's scale times 2^6 restores it exactly."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo, hi = torch.empty(256, dtype=torch.uint8), torch.empty(256, dtype=torch.uint8)
    _placed_kernel[(1,)](b, lo, hi)
    for placed, nibble in ((lo, b & 15), (hi, b >> 4)):
        value, want = placed.view(torch.float8_e4m3fn).float() * 64, Q.FP4_TABLE[nibble.long()]
        assert torch.equal(value, want) and torch.equal(torch.signbit(value), torch.signbit(want))


def test_halves_order_and_position_agree():
    """Within each 32-group, even K first then odd: the activation's permutation (halves_order, host)
    and the hidden state's stored column (halves_position, kernel) are the same map."""
    a = torch.arange(64).reshape(1, 64)
    order = moe_f8.halves_order(a)[0]
    assert order[:16].tolist() == list(range(0, 32, 2)) and order[16:32].tolist() == list(range(1, 32, 2))

    @triton.jit
    def positions(out_ptr):
        k = tl.arange(0, 64)
        tl.store(out_ptr + moe_f8.halves_position(k), k)

    got = torch.empty(64, dtype=torch.int32)
    positions[(1,)](got)
    assert torch.equal(got.long(), order)


@pytest.mark.parametrize("t,e,k,block_m,block_n,block_k", [(13, 4, 2, 16, 32, 64), (5, 6, 3, 8, 32, 32),
                                                           (40, 6, 3, 16, 64, 64)])
def test_fp8_form_against_its_reference(gen, t, e, k, block_m, block_n, block_k):
    """Every FP4 byte and small scale bytes in w1; several token blocks per expert, padding columns, I (64)
    split over row blocks. The FP8 form keeps the reference's numerics, which the bf16 form does not
    (it skips the E4M3 rounding of w * h and the bf16 roundings): 5% apart on these cases."""
    args = _case(gen, t, e=e, k=k, every_byte=True)
    got = moe.moe_fp4_triton(*args, fp8_mma=True, block_m=block_m, block_n=block_n, block_k=block_k)
    want = moe.moe_fp4_reference(*args, fp8_mma=True)
    assert _rel(want, got) < 1e-6, gen.initial_seed()
    assert (got == want).float().mean() > 0.99  # float32 sums of exact products, rounded to bf16 as float64's
    assert _rel(moe.moe_fp4_reference(*args), want) > 1e-2


@pytest.mark.parametrize("t,block_m,block_n,block_k,hidden", [(13, 16, 32, 64, "reference"), (1, 16, 64, 32, "fp32"),
                                                                (40, 64, 64, 64, "reference"), (7, 16, 32, 32, "fp32"),
                                                                (2, 16, 32, 32, "reference")])
def test_bf16_form_with_the_engines_hidden_state(gen, t, block_m, block_n, block_k, hidden):
    """hidden: the bf16 form (kernels/moe.py, NIB order, its own tiles) computing the engine's numerics, as
    the FP8 form does; up to 16 pairs on the GEMV path (its gate/up blocks widened to whole 32-row groups;
    the down sum rounded by the last of its K splits: 2 splits for 2 tokens, 1 for 1 and 7). The two numerics
    differ (bf16 roundings), so each is checked against its own."""
    args = _case(gen, t, e=4, k=2, every_byte=True)
    got = moe.moe_fp4_triton(*args, hidden=hidden, block_m=block_m, block_n=block_n, block_k=block_k,
                             gemv_block_n=16, gemv_block_kw=4, gemv_down_block_kw=4, gemv_down_iters=t % 2 + 1)
    assert close_but_one_token(moe.moe_fp4_reference(*args, hidden=hidden), got, 1e-6), gen.initial_seed()
    other = "fp32" if hidden == "reference" else "reference"
    assert _rel(moe.moe_fp4_reference(*args, hidden=other), got) > 1e-4
    with pytest.raises(ValueError, match="whole groups"):
        moe.moe_fp4_triton(*args, hidden=hidden, block_m=16, block_n=48, gemv_max_pairs=0)
    with pytest.raises(ValueError, match="unknown hidden-state numerics"):
        moe.moe_fp4_triton(*args, hidden="bf16")


@pytest.mark.parametrize("t", [1, 13])
def test_x_on_grid_skips_only_an_exact_round_trip(gen, t, monkeypatch):
    """x_on_grid (x already on the E4M3-per-32 grid): the bf16 form skips its x round trip; on x on that grid
    the result is bit for bit the round trip's (GEMV at 1 token, grouped at 13), and off it the skip shows (so
    the flag really skips). The kernel's own round trip (the engine's x) gives the same result, and in the
    grouped GEMM it stores the decoders' nibble order itself: no separate nib_order pass."""
    x, *rest = _case(gen, t, e=4, k=2)
    on_grid = Q.fp8_roundtrip(x.float(), 32).to(torch.bfloat16)
    knobs = dict(hidden="reference", block_m=16, block_n=32, gemv_block_kw=4, gemv_down_block_kw=4)
    want = moe.moe_fp4_triton(on_grid, *rest, **knobs)
    assert torch.equal(moe.moe_fp4_triton(on_grid, *rest, x_on_grid=True, **knobs), want)
    skipped = moe.moe_fp4_triton(x, *rest, x_on_grid=True, **knobs)
    monkeypatch.setattr(moe, "nib_order", lambda a: pytest.fail("a nib_order copy beside the round trip"))
    assert torch.equal(moe.moe_fp4_triton(x, *rest, **knobs), want)
    assert torch.equal(moe.moe_fp4_triton(x.float(), *rest, **knobs), want)
    assert not torch.equal(skipped, want)


def test_fp8_form_is_the_engines_routed_experts(gen):
    """kernels/moe_f8.py against engine/model/moe.py's routed experts under the reference numerics
    (ReferenceOps: bf16 act, fp32 sums per 32-K block; the activation and w * h through the engine's FP8
    round trip): the same computation, up to the order of sums inside each block. Almost always bit for bit
    (150 random seeds: all equal); where a hidden value sits on a rounding boundary, that order can flip its
    bf16 or E4M3 rounding (seed 616620992: one hidden value of token 5, 12 of its 128 outputs one bf16 step
    apart, rel 2.8e-5), hence 1e-4: a wrong scale, order or operand is 1e-2 and more."""
    x, w1, s1, w3, s3, w2, s2, ids, tw = _case(gen, 9, e=5, k=3)
    stacks = {"w1": (w1, s1), "w3": (w3, s3), "w2": (w2, s2)}
    weights = {f"f.experts.{ex}.{n}.weight": Q.dequantize_fp4(w[ex], s[ex], 32)
               for ex in range(5) for n, (w, s) in stacks.items()}
    cfg = SimpleNamespace(moe_inter_dim=w1.shape[1], dim=x.shape[1], swiglu_limit=10.0)
    ops = ReferenceOps()
    mine = routed_experts(cfg, "f.", x.float(), ids.long(), tw, weights.__getitem__,
                          lambda v, base: Q.fp8_roundtrip(v, 32), act=ops.act, gemm=ops.gemm)
    got = moe.moe_fp4_triton(x, w1, s1, w3, s3, w2, s2, ids, tw, fp8_mma=True, block_m=16, block_n=32)
    assert _rel(mine, got) < 1e-4, gen.initial_seed()


def test_fp8_form_skips_other_ranks_slots(gen):
    """Expert parallel (-1 ids: another rank's slots): each rank's share is its experts' reference, and
    the shares add up to the whole."""
    x, w1, s1, w3, s3, w2, s2, ids, tw = _case(gen, 5, e=4, k=2)
    whole = moe.moe_fp4_reference(x, w1, s1, w3, s3, w2, s2, ids, tw, fp8_mma=True)
    shares = []
    for a, b in ((0, 2), (2, 4)):
        local = torch.where((ids >= a) & (ids < b), ids - a, -1).to(torch.int32)
        stacks = (w1[a:b], s1[a:b], w3[a:b], s3[a:b], w2[a:b], s2[a:b])
        got = moe.moe_fp4_triton(x, *stacks, local, tw, fp8_mma=True, block_m=16, block_n=32)
        assert _rel(moe.moe_fp4_reference(x, *stacks, local, tw, fp8_mma=True), got) < 1e-6, gen.initial_seed()
        shares.append(got)
    assert _rel(whole, shares[0] + shares[1]) < 1e-6, gen.initial_seed()


def test_fp8_form_takes_every_width(gen):
    """One token (where the bf16 form takes its GEMV path) runs the same FP8 grouped path: one numerics
    for every batch width."""
    args = _case(gen, 1)
    got = moe.moe_fp4_triton(*args, fp8_mma=True)
    assert _rel(moe.moe_fp4_reference(*args, fp8_mma=True), got) < 1e-6, gen.initial_seed()


def test_fp8_form_rejects_ragged_blocks(gen):
    args = _case(gen, 3)
    with pytest.raises(ValueError, match="row blocks of whole groups"):
        moe.moe_fp4_triton(*args, fp8_mma=True, block_m=16, block_n=48)


def test_fp8_form_only_at_the_widths_where_it_measured_faster():
    """The kernel ops take the FP8 form (when asked) for the decode step's grouped widths only: the release's
    64 x 6 pairs over 384 experts, not one token's 6 (GEMV) nor a 4K-token prefill's 24,576."""
    assert moe.fp8_form_pays(64 * 6, 384)
    assert not moe.fp8_form_pays(6, 384) and not moe.fp8_form_pays(4096 * 6, 384)
