"""The split-K / FMA / bf16-split paths of the fused mHC kernel, on the CPU under TRITON_INTERPRET=1.

Each launch shape (FMA or dot mixes, one program per token block or d split across programs with the
finishing launch) is checked against the float64 reference at small shapes; outputs the kernel
allocates (the partial-sum workspace included) are NaN-poisoned so an unwritten element fails.
"""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch
import triton
import triton.language as tl

formats, mhc = interpreted("_formats", "mhc")


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(b).any(), "NaN in the kernel's output (unwritten or invalid)"
    return ((a - b).norm() / a.norm()).item()


def _inputs(gen, t, dim, dtype, with_post):
    x = torch.randn(t, 4, dim, generator=gen).to(dtype)
    fn = torch.randn(24, 4 * dim, generator=gen) * 0.05
    scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn(24, generator=gen) * 0.5
    pre_prev = torch.rand(t, 4, generator=gen)
    extra = ()
    if with_post:
        extra = (torch.randn(t, dim, generator=gen).to(dtype), torch.rand(t, 4, generator=gen) * 2,
                 torch.softmax(torch.randn(t, 4, 4, generator=gen), -1))
    return (x, fn, scale, base, pre_prev, *extra)


# (tokens, dim, kwargs, expected plan: token block, dot?, d splits)
SHAPES = [
    (1, 128, {}, (1, False, 4)),                                   # decode: one 32-wide chunk per program
    (3, 64, {"split_k": 1}, (4, False, 1)),                        # FMA mixes, finished in the same program
    (20, 64, {"token_block": 16, "split_k": 1}, (16, True, 1)),    # dot mixes, one launch
    (40, 128, {"token_block": 16, "split_k": 3}, (16, True, 2)),   # dot mixes, uneven splits -> 2 of 2 chunks
    (7, 256, {"split_k": 3}, (8, False, 3)),                       # 8 chunks over 3 splits (3, 3, 2)
    (70, 128, {"token_block": 64, "split_k": 2}, (64, True, 2)),   # 64-token blocks of 64-wide chunks
    (40, 128, {"token_block": 16, "split_k": 3, "finish": "launch"}, (16, True, 2)),  # the second launch
    # orient="tokens" (run 4's candidate): tokens as the MMA's M, each fn piece as B
    (20, 64, {"token_block": 16, "split_k": 1, "orient": "tokens"}, (16, True, 1)),
    (70, 128, {"token_block": 64, "split_k": 2, "orient": "tokens"}, (64, True, 2)),
    (40, 128, {"token_block": 32, "split_k": 4, "block_d": 32, "orient": "tokens"}, (32, True, 4)),
    (40, 128, {"token_block": 16, "split_k": 3, "finish": "launch", "orient": "tokens"}, (16, True, 2)),
    # 16-wide chunks (run 27a's deep-pipeline shapes: a 64-wide K a dot, 8 chunks over 2 splits)
    (70, 128, {"token_block": 64, "split_k": 2, "block_d": 16, "orient": "tokens"}, (64, True, 2)),
]


@pytest.mark.parametrize("t,dim,kw,plan", SHAPES)
@pytest.mark.parametrize("with_post", [False, True])
def test_mhc_paths_match_the_fp64_reference(poisoned, gen, t, dim, kw, plan, with_post):
    args = _inputs(gen, t, dim, torch.float32, with_post)
    bt, use_dot, _, ks, _ = mhc.mhc_plan(t, dim, "cpu", None, kw.get("token_block"), kw.get("split_k"))
    assert (bt, use_dot, ks) == plan
    want = mhc.mhc_reference(*args)
    got = mhc.mhc_triton(*args, **kw)
    for name, a, b in zip(("xn", "collapse", "pre", "post", "comb"), want, got):
        assert (a is None) == (b is None), name
        if a is not None:
            assert _rel(a, b) < 1e-6, (name, gen.initial_seed())
    assert torch.allclose(got[4].sum(-2), torch.ones(t, 4), atol=1e-4)  # doubly stochastic columns


@pytest.mark.parametrize("t,kw", [(20, {"token_block": 16, "split_k": 2}), (3, {}),
                                  (20, {"token_block": 16, "split_k": 2, "orient": "tokens"})])
def test_mhc_bf16_stream_fn_split_pieces(poisoned, gen, t, kw):
    """A bf16 stream (exact bf16 values, no update so no rounding of X'): fn cut into 3 bf16 pieces gives
    fp32 accuracy, 2 pieces about 2^-17 of |fn|; the FMA path (3 tokens) ignores the split."""
    args = _inputs(gen, t, 128, torch.bfloat16, False)
    want = mhc.mhc_reference(*args)
    err = {}
    for split in (0, 2, 3):
        got = mhc.mhc_triton(*args, split=split, **kw)
        err[split] = max(_rel(a, b) for a, b in zip(want[2:], got[2:]))
    assert err[3] < 1e-6 and err[0] < 1e-6, (err, gen.initial_seed())
    if kw.get("token_block"):
        assert 1e-7 < err[2] < 3e-5, (err, gen.initial_seed())   # the third piece is doing work
    else:
        assert err[2] < 1e-6, err


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, formats.cast_rne(tl.load(x_ptr + i), tl.bfloat16))


def test_bf16_stores_round_to_nearest_even(gen):
    """cast_rne: float32 -> bf16 as torch (and the GPU) round it, where the interpreter's own cast
    truncates: normal values over 60 binades, ties to even both ways, overflow to inf, inf and NaN."""
    mags = 2.0 ** torch.randint(-60, 60, (4000,), generator=gen).float()
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3961776e38, 3.3895314e38])
    x = torch.cat([torch.randn(4000, generator=gen) * mags, ties,
                   torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])])
    x = torch.cat([x, torch.zeros(4096 - x.numel())])
    got = torch.empty(4096, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, got, N=4096)
    want = x.bfloat16()
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))
    assert (x.to(torch.bfloat16) != x).sum() > 3000  # most values do round


def test_bf16_stream_update_is_stored_rounded(poisoned, gen):
    """A bf16 stream with the post/comb update: X' is stored in bf16 rounded to nearest (the mixes read
    those values, as the reference's do), within one bf16 step of the float64 reference's rounding."""
    args = _inputs(gen, 20, 64, torch.bfloat16, True)
    want = mhc.mhc_reference(*args)
    got = mhc.mhc_triton(*args, token_block=16, split_k=1)
    assert got[0].dtype == torch.bfloat16
    # one bf16 step, and no less than float32's own error on these O(1) sums (2^-20 ~ 4 x 4 terms x 2^-24): an X'
    # that cancels to ~1e-5 can round differently by more than its own tiny step (a fresh clone's run hit one)
    step = (want[0].float().abs() * 2.0**-7).clamp_min(2.0**-20)
    assert ((got[0].float() - want[0].float()).abs() <= step).all()
    assert (got[0] == want[0]).float().mean() > 0.99


@pytest.mark.parametrize("t,dim,kw", [(20, 64, {"token_block": 16, "split_k": 1}), (3, 64, {"split_k": 1}),
                                      (1, 128, {}), (40, 128, {"token_block": 16, "split_k": 3, "finish": "launch"}),
                                      (70, 128, {"token_block": 64, "split_k": 2, "block_d": 16, "orient": "tokens"})])
@pytest.mark.parametrize("with_post", [False, True])
def test_float32_stream_of_bf16_values_is_the_bf16_stream(poisoned, gen, t, dim, kw, with_post):
    """bf16_values: the stream (and y) as float32 tensors of bf16 values, read as they are: every output the
    bf16 stream's, bit for bit (the update and the collapse rounded to bf16 values, stored float32), and within
    one bf16 step of the float64 reference's rounding."""
    args = _inputs(gen, t, dim, torch.bfloat16, with_post)
    wide = tuple(a.float() if a.dtype == torch.bfloat16 else a for a in args)
    narrow_out = mhc.mhc_triton(*args, **kw)
    wide_out = mhc.mhc_triton(*wide, bf16_values=True, **kw)
    for name, a, b in zip(("xn", "collapse", "pre", "post", "comb"), narrow_out, wide_out):
        assert (a is None) == (b is None), name
        if a is not None:
            assert b.dtype == torch.float32 and torch.equal(a.float(), b), (name, gen.initial_seed())
    # against float64: the update within one bf16 step (or float32 rounding of O(1) terms where they cancel near
    # zero); the collapse against the collapse of the kernel's own stored stream (a one-step difference in the
    # update carries into it, times pre), within one step of it
    want = mhc.mhc_reference(*wide, bf16_values=True)
    within = lambda a, b: ((a - b).abs() <= a.abs() * 2.0**-7 + 1e-5).all()  # noqa: E731
    if want[0] is not None:
        assert torch.equal(want[0].bfloat16().float(), want[0])  # the reference rounds too
        assert within(want[0], wide_out[0]), gen.initial_seed()
    stream = wide[0] if wide_out[0] is None else wide_out[0]
    collapse = torch.einsum("tc,tcd->td", wide[4].double(), stream.double()).bfloat16().float()
    assert within(collapse, wide_out[1]), gen.initial_seed()
    with pytest.raises(ValueError, match="bf16_values"):
        mhc.mhc_triton(*args, bf16_values=True, **kw)


def test_mhc_plan_at_release_shapes():
    """dim 5120: 1 token -> 160 FMA programs of one 32-wide chunk; 4K tokens -> 64-token dot blocks x
    2 d splits (128 programs of 40 64-wide chunks, one wave of 132 SMs)."""
    assert mhc.mhc_plan(1, 5120, "cpu") == (1, False, 32, 160, 1)
    assert mhc.mhc_plan(4096, 5120, "cpu") == (64, True, 64, 2, 40)
    assert mhc.mhc_plan(4096, 5120, "cpu", split_k=1)[3] == 1
    assert mhc.mhc_plan(64, 5120, "cpu")[:4] == (32, True, 32, 54)  # a decode batch: 2 blocks x 54 splits
    assert mhc.mhc_plan(16, 5120, "cpu")[:2] == (16, True)


def test_mhc_bad_shapes_and_options(gen):
    args = _inputs(gen, 2, 96, torch.float32, False)
    with pytest.raises(ValueError, match="multiple of the d block"):
        mhc.mhc_triton(*args, block_d=64)
    with pytest.raises(ValueError, match="bf16 stream"):
        mhc.mhc_triton(*_inputs(gen, 2, 64, torch.float32, False), split=3)
    with pytest.raises(ValueError, match="orient must be"):
        mhc.mhc_triton(*args, orient="rows")
    with pytest.raises(ValueError, match="split must be"):
        mhc.mhc_triton(*_inputs(gen, 2, 64, torch.bfloat16, False), split=1)
    x, *rest = _inputs(gen, 2, 64, torch.float32, False)
    out = mhc.mhc_triton(x[:0], rest[0], rest[1], rest[2], rest[3][:0])
    assert out[0] is None and out[1].shape == (0, 64) and out[4].shape == (0, 4, 4)


def test_mhc_fn_pieces_layout_and_exactness(gen):
    """Column 4 d + j of the dot path's A operand is fn[:, j dim + d]; 3 bf16 pieces sum to fn within
    2^-24 of |fn| (2 pieces: 2^-16), and piece 0 is fn rounded to bf16."""
    dim = 32
    fn = torch.randn(24, 4 * dim, generator=gen)
    want = torch.stack([fn[:, j * dim:(j + 1) * dim] for j in range(4)], -1).reshape(24, 4 * dim)
    assert torch.equal(mhc.mhc_fn_pieces(fn, 0), want)
    p3 = mhc.mhc_fn_pieces(fn, 3)
    assert p3.shape == (72, 4 * dim) and p3.dtype == torch.bfloat16
    assert torch.equal(p3[:24], want.bfloat16())
    for k, bound in ((3, 2.0**-24), (2, 2.0**-16)):
        s = mhc.mhc_fn_pieces(fn, k).double().view(k, 24, 4 * dim).sum(0)
        assert ((s - want.double()).abs() <= bound * want.double().abs()).all(), k


def test_mhc_counters_reset_and_pieces_follow_fn_updates(poisoned, gen):
    """The last-arriver finish leaves its counters at zero (a second call is right too), and an in-place
    change of fn (a new tensor version) is seen: the cached pieces are made again."""
    x, fn, *rest = _inputs(gen, 40, 128, torch.float32, True)
    kw = {"token_block": 16, "split_k": 4}
    for _ in range(2):
        got = mhc.mhc_triton(x, fn, *rest, **kw)
        want = mhc.mhc_reference(x, fn, *rest)
        assert max(_rel(a, b) for a, b in zip(want[2:], got[2:])) < 1e-6
        assert not mhc._COUNTERS[x.device].any()
        fn.mul_(-1.5)


def test_mhc_under_inference_mode(gen):
    """Weights loaded under torch.inference_mode have no version counter: the dot path (which caches fn's
    pieces) still runs there, matches the reference, and reuses the pieces on a second call."""
    with torch.inference_mode():
        args = _inputs(gen, 20, 64, torch.float32, True)
        kw = {"token_block": 16, "split_k": 1}
        want = mhc.mhc_reference(*args)
        for _ in range(2):
            got = mhc.mhc_triton(*args, **kw)
            assert max(_rel(a, b) for a, b in zip(want[2:], got[2:])) < 1e-6
        assert mhc._cached_pieces(args[1], 3) is mhc._cached_pieces(args[1], 3)


@pytest.mark.parametrize("t,dim,block_d", [(5, 5120, 1024), (3, 100, 64)])
def test_expand_is_the_reference_update_bit_for_bit(gen, t, dim, block_d):
    """The FFN's stream update alone (mhc_expand): the reference numerics' float32 sums in their order, rounded
    to bf16, bit for bit (the kernel is launched without FMA contraction); a width no power of two and a
    partial last block; against float64 within the bf16 rounding."""
    residual = (torch.randn(t, 4, dim, generator=gen) * 2).bfloat16().float()
    y = torch.randn(t, dim, generator=gen).bfloat16().float()
    post = torch.rand(t, 4, generator=gen) * 2
    comb = torch.softmax(torch.randn(t, 4, 4, generator=gen), -1)
    got = mhc.mhc_expand_triton(y, residual, post, comb, block_d=block_d)
    want = mhc.mhc_expand_reference(y, residual, post, comb)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    exact = torch.einsum("tij,tid->tjd", comb.double(), residual.double()) + post.double()[..., None] * y.double()[:, None]
    assert ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all()
    # the stream stored bf16 (knob stream_bf16): read and written as bf16, the same values
    narrow = mhc.mhc_expand_triton(y, residual.bfloat16(), post, comb, block_d=block_d, bf16_out=True)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), got)
    # y stored bf16 too (the shared-expert sum under the bf16 stream): read as it is, the same values
    assert torch.equal(mhc.mhc_expand_triton(y.bfloat16(), residual.bfloat16(), post, comb, block_d=block_d,
                                             bf16_out=True), narrow)
    assert torch.equal(mhc.mhc_expand_reference(y, residual.bfloat16(), post, comb, bf16_out=True), narrow)
    with pytest.raises(ValueError, match="expand"):
        mhc.mhc_expand_triton(y, residual[:, :3], post, comb)
