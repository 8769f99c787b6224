"""The RoPE kernel (kernels/rope.py) on the CPU under TRITON_INTERPRET=1: against a float64 rotation by the
same (cos, sin) table, and against the reference numerics' own rotation (engine/ops/reference.py), including
the inverse, per-head rows and a fully rotated row; and the kernel ops take it for `reference` numerics."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

from engine.ops.reference import ReferenceOps

_, rope = interpreted("_formats", "rope")


def _float64(x, positions, table, inverse):
    """Pair by pair in float64: (a + ib)(c + is), s negated when inverse; the other dims as they are."""
    rd = table.shape[1] * 2
    out = x.double().clone()
    cs = table[positions].double()  # [T, rd/2, 2]
    c, s = cs[..., 0], cs[..., 1] * (-1 if inverse else 1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    c, s = c.view(shape), s.view(shape)
    a, b = x[..., -rd:][..., 0::2].double(), x[..., -rd:][..., 1::2].double()
    out[..., -rd:][..., 0::2] = a * c - b * s
    out[..., -rd:][..., 1::2] = a * s + b * c
    return out


def _terms(x, positions, table):
    """The size of each output's terms, |a c| + |b s| on the rotated dims (|x| elsewhere): where the two products
    cancel, float32's rounding of them (2^-24 of this, twice) is what separates the kernel from float64."""
    rd = table.shape[1] * 2
    out = x.double().abs().clone()
    cs = table[positions].double().abs()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    c, s = cs[..., 0].view(shape), cs[..., 1].view(shape)
    a, b = out[..., -rd:][..., 0::2].clone(), out[..., -rd:][..., 1::2].clone()
    out[..., -rd:][..., 0::2] = a * c + b * s
    out[..., -rd:][..., 1::2] = a * s + b * c
    return out


@pytest.mark.parametrize("shape,rd,inverse", [((16, 8, 512), 64, False),   # a decode step's queries, per head
                                              ((16, 8, 512), 64, True),    # the output's inverse rotation
                                              ((33, 128), 128, False),     # a whole index key rotated
                                              ((5, 3, 100), 20, True)])    # a width no power of two
def test_matches_float64_and_the_reference_rotation(gen, shape, rd, inverse):
    ops = ReferenceOps(max_seq_len=4096)
    freqs = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    table = torch.view_as_real(ops._rope_table(freqs, "cpu"))
    x = (torch.randn(*shape, generator=gen) * 3).bfloat16().float()
    positions = torch.randint(0, 4096, (shape[0],), generator=gen)
    got = rope.rope_triton(x, positions, table, inverse)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.bfloat16().float(), got)  # stored as bf16 values
    want = _float64(x, positions, table, inverse)
    # within bf16 rounding, plus float32's rounding of the two products where they cancel (seed 26 of the last
    # case: 9.25e-5 against float64's 9.29e-5 from products of ~5, as the reference's own float32 rotation gives)
    bound = 2 ** -8 * want.abs() + 2 ** -22 * _terms(x, positions, table) + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(got[..., :-rd], x[..., :-rd])  # the other dims kept (bf16 already)
    ref = ops.rotate(x, positions, freqs, inverse)
    assert torch.equal(rope.rope_reference(x, positions, table, inverse), ref)
    assert (got != ref).float().mean() < 1e-3  # one bf16 step where float32 products straddle a boundary
    # in place (bf16 values in x): only the rotated dims rewritten, the same bits as the out-of-place kernel
    for run in (rope.rope_triton, rope.rope_reference):
        want_here = got if run is rope.rope_triton else ref
        for y in (x.clone(), x.bfloat16()):  # float32 of bf16 values, or bf16 itself (the attention's output)
            back = run(y, positions, table, inverse, inplace=True)
            assert back is y and torch.equal(y.float(), want_here), y.dtype
    # a non-contiguous x cannot be rewritten in place: a new tensor, x untouched
    wide = torch.cat([x, x], -1)[..., : shape[-1]]
    kept = wide.clone()
    assert torch.equal(rope.rope_triton(wide, positions, table, inverse, inplace=True), got)
    assert torch.equal(wide, kept)


def test_rejects_bad_shapes():
    table = torch.zeros(8, 4, 2)
    with pytest.raises(ValueError, match="D - rd even"):
        rope.rope_triton(torch.zeros(2, 9), torch.zeros(2, dtype=torch.long), table)
    with pytest.raises(ValueError, match="positions must be"):
        rope.rope_triton(torch.zeros(2, 16), torch.zeros(3, dtype=torch.long), table)
