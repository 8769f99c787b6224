"""The Engram's gated update (kernels/engram.py) on the CPU under TRITON_INTERPRET=1, against a float64 loop
written from the release's formulas, and against the engine's own op (engine/model/engram.py engram_mix)."""

from interpreted import interpreted  # first: the interpreter before triton

import math

import pytest
import torch

_, engram = interpreted("_formats", "engram")

GATE_CLAMP = 1e-6


def _float64(x, kv, qw, kw, eps, mask=None):
    """Token by token, copy by copy, in float64."""
    t, hc, d = x.shape
    x, kv, w = x.double(), kv.double(), qw.double() * kw.double()
    out = torch.empty_like(x)
    for i in range(t):
        value = kv[i, hc * d:]
        for c in range(hc):
            h, key = x[i, c], kv[i, c * d:(c + 1) * d]
            rstd = 1 / math.sqrt((h * h).sum().item() / d + eps) / math.sqrt((key * key).sum().item() / d + eps)
            dot = (h * w[c] * key).sum().item() * rstd / math.sqrt(d)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), GATE_CLAMP)), dot)))
            if mask is not None and not mask[i]:
                gate = 0.0
            out[i, c] = h + gate * value
    return out


def _inputs(gen, t, hc, d, scale=1.0):
    x = (torch.randn(t, hc, d, generator=gen) * scale).bfloat16().float()  # the stream holds bf16 values
    kv = torch.randn(t, (hc + 1) * d, generator=gen).bfloat16().float()
    qw, kw = torch.rand(hc, d, generator=gen) + 0.5, torch.randn(hc, d, generator=gen)
    return x, kv, qw, kw


@pytest.mark.parametrize("t, hc, d", [(5, 4, 64), (3, 4, 96), (2, 4, 4096), (4, 2, 40)])
def test_against_the_float64_loop_and_the_engines_rounding(t, hc, d):
    gen = torch.Generator().manual_seed(1000 + d)
    x, kv, qw, kw = _inputs(gen, t, hc, d)
    mask = torch.tensor([i % 3 != 1 for i in range(t)])
    for m in (None, mask):
        want = _float64(x, kv, qw, kw, 1e-6, m)
        got = engram.engram_mix_triton(x, kv, qw, kw, 1e-6, m)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert ((got.double() - want).abs() <= 1e-6 * want.abs() + 1e-6).all(), gen.initial_seed()
        # bf16-rounded: the engine's rounding of its own float32 result, but where the two float32 results
        # straddle a rounding boundary (one bf16 step apart, rare)
        got_r = engram.engram_mix_triton(x, kv, qw, kw, 1e-6, m, round_bf16=True)
        want_r = engram.engram_mix_reference(x, kv, qw, kw, 1e-6, m, round_bf16=True)
        assert torch.equal(got_r.bfloat16().float(), got_r)
        differ = got_r != want_r
        assert differ.float().mean() < 1e-2, gen.initial_seed()
        assert ((got_r - want_r).abs()[differ] <= want_r.abs()[differ] * 2.0**-7).all()
        # the stream stored bf16 (knob stream_bf16): a bf16 x in, the rounded values stored bf16
        narrow = engram.engram_mix_triton(x.bfloat16(), kv, qw, kw, 1e-6, m, round_bf16=True, bf16_out=True)
        assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), got_r)
        want_n = engram.engram_mix_reference(x.bfloat16(), kv, qw, kw, 1e-6, m, round_bf16=True, bf16_out=True)
        assert want_n.dtype == torch.bfloat16 and torch.equal(want_n.float(), want_r)
    # a masked token's copies come out as they went in, bit for bit
    got = engram.engram_mix_triton(x, kv, qw, kw, 1e-6, mask)
    assert torch.equal(got[~mask], x[~mask])


def test_the_gate_is_signed_as_torch_signs_it():
    """Gates at their clamp on both sides: a tiny negative dot takes the negative root; a dot that is a sum of
    negative zeros (a zero copy against keys whose products with the weights are all negative) the positive
    one, as torch's sum (from +0) gives +0 there; for widths that fill the block and widths that do not."""
    for d in (64, 48):
        gen = torch.Generator().manual_seed(d)
        x, kv, qw, kw = _inputs(gen, 2, 4, d)
        kw[:] = kw.abs() + 0.1           # positive weights
        x[0] = 0.0                       # token 0: every product a zero, -0 against the negative keys
        kv[0, : 4 * d] = -1.0
        kv[0, d: 2 * d] = 1.0            # copy 1: +0 products
        x[1] = 1e-30                     # token 1: products of ~1e-30, normalized to a dot of ~1 ...
        kv[1, : 4 * d] = -1.0            # ... negative for every copy, then scaled to a tiny negative dot
        got = engram.engram_mix_triton(x, kv, qw, kw, 1e-6)
        want = engram.engram_mix_reference(x, kv, qw, kw, 1e-6)
        half = 1 / (1 + math.exp(-math.sqrt(GATE_CLAMP)))
        assert (got[0, :, 0] / kv[0, 4 * d]).tolist() == pytest.approx([half] * 4, rel=1e-6)
        assert ((got[1] - x[1]) / kv[1, 4 * d:]).max() < 0.5  # gate below a half: the negative root
        assert ((got - want).abs() <= 1e-6 * want.abs() + 1e-9).all()


def test_shapes_are_checked():
    x, kv, qw, kw = _inputs(torch.Generator().manual_seed(3), 2, 4, 32)
    with pytest.raises(ValueError, match="kv must be"):
        engram.engram_mix_triton(x, kv[:, :-1], qw, kw, 1e-6)
    with pytest.raises(ValueError, match="q_weight must be"):
        engram.engram_mix_triton(x, kv, qw[:3], kw, 1e-6)
    with pytest.raises(ValueError, match="token_mask must be"):
        engram.engram_mix_triton(x, kv, qw, kw, 1e-6, torch.ones(2))
    assert engram.engram_mix_triton(x[:0], kv[:0], qw, kw, 1e-6).shape == (0, 4, 32)


def test_the_kernel_op_stores_what_the_numerics_store(monkeypatch):
    """TritonOps.engram_mix: the kernel, rounded to bf16 values over `reference` numerics (their act) and
    not over fp32 numerics; equal to the wrapped op's result to the kernel's precision."""
    import engine.ops.triton as kernel_ops
    from engine.ops import ops_for

    monkeypatch.setattr(kernel_ops, "checkpoint_backed", lambda weights: True)
    x, kv, qw, kw = _inputs(torch.Generator().manual_seed(4), 6, 4, 64)
    mask = torch.tensor([True, False, True, True, True, False])
    for numerics, rounded in (("reference", True), ("fp32", False)):
        ops = kernel_ops.TritonOps(ops_for(numerics), type("W", (), {"reader": None})(), "cpu")
        got = ops.engram_mix(x, kv, qw, kw, 1e-6, mask)
        want = ops.base.engram_mix(x, kv, qw, kw, 1e-6, mask)
        assert ops.calls["engram_mix"] == 1
        assert torch.equal(got.bfloat16().float(), got) == rounded  # bf16 values only where act rounds
        assert ((got - want).abs() <= want.abs() * (2.0**-7 if rounded else 1e-6) + 1e-6).all(), numerics
