"""The RMSNorm kernel (kernels/rmsnorm.py) on the CPU under TRITON_INTERPRET=1, against a float64 loop."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

_, rmsnorm = interpreted("_formats", "rmsnorm")


def _float64(x, weight, eps):
    """Row by row in float64: x / sqrt(mean(x^2) + eps) * weight."""
    x = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(x)
    for i, row in enumerate(x):
        out[i] = row / torch.sqrt((row * row).sum() / row.numel() + eps)
    if weight is not None:
        out = out * weight.double()
    return out


def _check_against_references(gen, x, weight, **cfg):
    """rms_norm_triton(**cfg) on float32 rows, bf16-rounded and bf16 rows against the float64 loop and
    the reference's rounding."""
    want = _float64(x, weight, 1e-6).view(x.shape)
    got = rmsnorm.rms_norm_triton(x, weight, 1e-6, **cfg)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got.double() - want).abs() <= 4e-7 * want.abs() + 1e-30).all(), gen.initial_seed()  # a few fp32 ulps
    # bf16-rounded output: the reference's rounding of its own float32 result, but where the two float32
    # results straddle a rounding boundary (one bf16 step apart, rare)
    got_r = rmsnorm.rms_norm_triton(x, weight, 1e-6, round_bf16=True, **cfg)
    want_r = rmsnorm.rms_norm_reference(x, weight, 1e-6, round_bf16=True)
    assert torch.equal(got_r.bfloat16().float(), got_r)  # values are bf16
    differ = got_r != want_r
    assert differ.float().mean() < 1e-3, gen.initial_seed()
    assert ((got_r - want_r).abs()[differ] <= want_r.abs()[differ] * 2.0**-7).all()
    # bf16 rows in and out (PERFORMANCE.md's row): the same rounded values, stored as bf16
    xb = x.bfloat16()
    got_b = rmsnorm.rms_norm_triton(xb, weight, 1e-6, out_dtype=torch.bfloat16, **cfg)
    assert got_b.dtype == torch.bfloat16 and got_b.shape == x.shape
    assert torch.equal(got_b.float(), rmsnorm.rms_norm_triton(xb, weight, 1e-6, round_bf16=True, **cfg))
    want_b = _float64(xb.float(), weight, 1e-6).view(x.shape)
    assert ((got_b.double() - want_b).abs() <= want_b.abs() * 2.0**-8 + 1e-30).all()  # half a bf16 step
    return got_b


@pytest.mark.parametrize("lead,d,with_weight,rows_per_program", [
    ((64,), 5120, True, None),      # a decode step's rows at the release's width: one row a program
    ((5, 3), 512, False, None),     # per-head rows, several a program, no weight
    ((33,), 1000, True, 4),         # a width that is no power of two, a partial last block
])
def test_matches_float64_and_rounds_as_the_reference(gen, lead, d, with_weight, rows_per_program):
    x = torch.randn(*lead, d, generator=gen) * 3
    weight = torch.randn(d, generator=gen) if with_weight else None
    _check_against_references(gen, x, weight, rows_per_program=rows_per_program)


@pytest.mark.parametrize("rows,d,chunk,programs_per_sm,with_weight", [
    (37, 5120, 1024, 0, True),    # the release's width, five whole chunks, a row a program
    (37, 5120, 2048, 0, False),   # two whole chunks and a masked half chunk
    (300, 1000, 256, 1, True),    # a width no chunk divides, 132 programs walking 2-3 rows each
    (7, 1500, 4096, 2, False),    # a chunk wider than the row (cut to 2048, masked), fewer rows than programs
])
def test_chunked_form_matches_float64_and_rounds_as_the_reference(gen, rows, d, chunk, programs_per_sm,
                                                                   with_weight):
    x = torch.randn(rows, d, generator=gen) * 3
    weight = torch.randn(d, generator=gen) if with_weight else None
    cfg = dict(chunk=chunk, programs_per_sm=programs_per_sm)
    got_b = _check_against_references(gen, x, weight, **cfg)
    # against today's whole-row kernel: the sums of squares only added in another order
    xb = x.bfloat16()
    whole = rmsnorm.rms_norm_triton(xb, weight, 1e-6, out_dtype=torch.bfloat16)
    differ = got_b != whole
    assert differ.float().mean() < 1e-3, gen.initial_seed()
    assert ((got_b.float() - whole.float()).abs()[differ] <= whole.float().abs()[differ] * 2.0**-7).all()
    # eviction hints change no value
    assert torch.equal(rmsnorm.rms_norm_triton(xb, weight, 1e-6, out_dtype=torch.bfloat16, hints=True, **cfg), got_b)


@pytest.mark.parametrize("rows,d,programs_per_sm,with_weight", [
    (300, 1000, 1, True),  # 132 programs walking 2-3 rows each, the last prefetch masked off
    (7, 512, 2, False),    # fewer rows than programs: one row each
])
def test_row_walking_kernel_gives_the_same_values(gen, rows, d, programs_per_sm, with_weight):
    x = torch.randn(rows, d, generator=gen) * 3
    weight = torch.randn(d, generator=gen) if with_weight else None
    for xin, out_dtype in ((x, torch.float32), (x.bfloat16(), torch.bfloat16)):
        want = rmsnorm.rms_norm_triton(xin, weight, 1e-6, round_bf16=True, out_dtype=out_dtype)
        got = rmsnorm.rms_norm_triton(xin, weight, 1e-6, round_bf16=True, out_dtype=out_dtype,
                                      programs_per_sm=programs_per_sm)
        assert got.dtype == out_dtype and torch.equal(got, want)  # the same arithmetic, row for row
        for c in (dict(hints=True), dict(hints=True, programs_per_sm=programs_per_sm)):  # no value changes
            again = rmsnorm.rms_norm_triton(xin, weight, 1e-6, round_bf16=True, out_dtype=out_dtype, **c)
            assert torch.equal(again, got)
    want = _float64(x, weight, 1e-6)
    got = rmsnorm.rms_norm_triton(x, weight, 1e-6, programs_per_sm=programs_per_sm)
    assert ((got.double() - want).abs() <= 4e-7 * want.abs() + 1e-30).all()


def test_empty_rows_and_bad_shapes(gen):
    assert rmsnorm.rms_norm_triton(torch.zeros(0, 64), None, 1e-6).shape == (0, 64)
    with pytest.raises(ValueError, match="weight must be"):
        rmsnorm.rms_norm_triton(torch.randn(2, 64, generator=gen), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        rmsnorm.rms_norm_triton(torch.randn(1, 32768, generator=gen), None, 1e-6)
    with pytest.raises(ValueError, match="chunk must be"):
        rmsnorm.rms_norm_triton(torch.randn(2, 64, generator=gen), None, 1e-6, chunk=48)
    assert rmsnorm.rms_norm_triton(torch.zeros(0, 64), None, 1e-6, chunk=64).shape == (0, 64)
    with pytest.raises(ValueError, match="out_dtype"):
        rmsnorm.rms_norm_triton(torch.randn(2, 64, generator=gen), None, 1e-6, out_dtype=torch.float16)


def _bits(t):
    """The stored bits of a float32 / bf16 tensor (bit-for-bit comparison: -0.0 and NaN payloads too)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("lead,d,bf16_rows,cfg", [
    ((5, 3), 512, False, dict(round_bf16=True)),                     # whole rows, several a program, 3-D x
    ((37,), 5120, True, dict(chunk=1024)),                           # the release's row in chunks, bf16 rows
    ((140,), 1000, True, dict(chunk=256, programs_per_sm=1, hints=True)),  # 132 walkers, some 2 rows; masked tail
    ((7,), 512, False, dict(programs_per_sm=2)),                     # the row-walking kernel, float32 out
])
def test_preallocated_out_is_written_and_returned(gen, lead, d, bf16_rows, cfg):
    """out=: the same bits as the allocating call, written into the given buffer, which is returned."""
    x = torch.randn(*lead, d, generator=gen) * 3
    weight = torch.randn(d, generator=gen)
    if bf16_rows:
        x, cfg = x.bfloat16(), dict(cfg, out_dtype=torch.bfloat16)
    want = rmsnorm.rms_norm_triton(x, weight, 1e-6, **cfg)
    buf = torch.full(x.shape, float("nan"), dtype=want.dtype)  # an element left unwritten stays NaN
    ptr = buf.data_ptr()
    got = rmsnorm.rms_norm_triton(x, weight, 1e-6, out=buf, **cfg)
    assert got is buf and got.data_ptr() == ptr and got.shape == x.shape
    assert torch.equal(_bits(got), _bits(want))
    # written again in place (the bench's reuse): the same bits, the same buffer
    again = rmsnorm.rms_norm_triton(x, weight, 1e-6, out=buf, **cfg)
    assert again is buf and torch.equal(_bits(buf), _bits(want))


def test_preallocated_out_is_checked(gen):
    x = torch.randn(2, 64, generator=gen)
    call = lambda out, **k: rmsnorm.rms_norm_triton(x, None, 1e-6, out=out, **k)  # noqa: E731
    with pytest.raises(ValueError, match=r"out must have x's shape \(2, 64\), got \(2, 32\)"):
        call(torch.empty(2, 32))
    with pytest.raises(ValueError, match=r"out must have x's shape \(2, 64\), got \(128,\)"):
        call(torch.empty(128))  # the same number of values is not enough
    with pytest.raises(ValueError, match=r"out must be torch.float32 \(the call's out_dtype\), got torch.bfloat16"):
        call(torch.empty(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 \(the call's out_dtype\), got torch.float32"):
        call(torch.empty(2, 64), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be contiguous, got strides \(1, 2\) for shape \(2, 64\)"):
        call(torch.empty(64, 2).t())
    with pytest.raises(ValueError, match=r"out must be on x's device cpu, got meta"):
        call(torch.empty(2, 64, device="meta"))
    bad = torch.full((2, 64), 7.0)
    with pytest.raises(ValueError, match="weight must be"):  # the call's own checks still come first
        rmsnorm.rms_norm_triton(x, torch.ones(32), 1e-6, out=bad)
    assert (bad == 7.0).all()  # a refused call writes nothing
    empty = torch.empty(0, 64)
    assert rmsnorm.rms_norm_triton(torch.zeros(0, 64), None, 1e-6, out=empty) is empty
