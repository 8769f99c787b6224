"""The shared expert's elementwise kernels (kernels/elementwise.py) on the CPU under TRITON_INTERPRET=1: SwiGLU
against a float64 formula and the engine's own op, the sum bit for bit; and the kernel ops' rounding."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

_, ew = interpreted("_formats", "elementwise")


def _values(gen, *shape, scale=4.0):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16().float()


@pytest.mark.parametrize("shape, limit", [((64, 96), 10.0), ((3, 5000), 7.0), ((17, 33), 0.0)])
def test_swiglu_against_float64_and_the_engine(shape, limit):
    gen = torch.Generator().manual_seed(shape[1])
    gate, up = _values(gen, *shape, scale=limit or 4.0), _values(gen, *shape, scale=limit or 4.0)
    g, u = gate.double(), up.double()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    want = g / (1 + torch.exp(-g)) * u
    got = ew.swiglu_triton(gate, up, limit)
    assert got.dtype == torch.float32 and got.shape == gate.shape
    assert ((got.double() - want).abs() <= 1e-6 * want.abs() + 1e-6).all()
    if limit > 0:  # the clamps bite: values past the limit were drawn
        assert (gate > limit).any() and (up.abs() > limit).any()
    got_r = ew.swiglu_triton(gate, up, limit, round_bf16=True)
    want_r = ew.swiglu_reference(gate, up, limit, round_bf16=True)
    assert torch.equal(got_r.bfloat16().float(), got_r)
    # stored bf16 (its reader, w2's linear, takes bf16): the same values, as the reference stores them
    narrow = ew.swiglu_triton(gate, up, limit, round_bf16=True, bf16_out=True)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), got_r)
    assert ew.swiglu_reference(gate, up, limit, bf16_out=True).dtype == torch.bfloat16
    differ = got_r != want_r
    assert differ.float().mean() < 1e-2 and ((got_r - want_r).abs()[differ] <= want_r.abs()[differ] * 2.0**-7).all()


def test_add_is_torchs_sum_bit_for_bit():
    gen = torch.Generator().manual_seed(9)
    a, b = _values(gen, 40, 300), _values(gen, 40, 300)
    assert torch.equal(ew.add_triton(a, b), a + b)
    assert torch.equal(ew.add_triton(a, b, round_bf16=True), (a + b).bfloat16().float())
    assert torch.equal(ew.add_triton(a.bfloat16(), b), a + b)  # bf16 in, float32 out
    for out in (ew.add_triton(a, b, bf16_out=True), ew.add_reference(a, b, bf16_out=True)):  # bf16 out: rounded
        assert out.dtype == torch.bfloat16 and torch.equal(out, (a + b).bfloat16())
    with pytest.raises(ValueError, match="differ"):
        ew.add_triton(a, b[:, :-1])
    assert ew.swiglu_triton(a[:0], b[:0], 1.0).shape == (0, 300)


def test_the_kernel_ops_store_what_the_numerics_store(monkeypatch):
    """TritonOps.swiglu / add: the kernels, rounded to bf16 values over `reference` numerics (their act) and not
    over fp32 numerics; the same values as the wrapped ops' to the kernels' precision (the sum: exactly)."""
    import engine.ops.triton as kernel_ops
    from engine.ops import ops_for

    monkeypatch.setattr(kernel_ops, "checkpoint_backed", lambda weights: True)
    gen = torch.Generator().manual_seed(4)
    a, b = _values(gen, 8, 64), _values(gen, 8, 64)
    for numerics, rounded in (("reference", True), ("fp32", False)):
        ops = kernel_ops.TritonOps(ops_for(numerics), type("W", (), {"reader": None})(), "cpu")
        assert torch.equal(ops.add(a, b), ops.base.add(a, b))
        got, want = ops.swiglu(a, b, 5.0), ops.base.swiglu(a, b, 5.0)
        assert ops.calls["add"] == ops.calls["swiglu"] == 1
        assert torch.equal(got.bfloat16().float(), got) == rounded
        assert ((got - want).abs() <= want.abs() * (2.0**-7 if rounded else 1e-6) + 1e-6).all(), numerics
