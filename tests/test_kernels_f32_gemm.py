"""The float32 GEMM on tensor cores (kernels/f32_gemm.py) on the CPU under TRITON_INTERPRET=1 against a float64
product, ragged shapes and the router's width, and the kernel op's knob (TritonOps.f32_linear)."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

_, f32_gemm = interpreted("_formats", "f32_gemm")


@pytest.mark.parametrize("m, n, k, cfg", [(300, 384, 512, {}), (70, 50, 200, {"block_k": 64}),
                                          (129, 130, 96, {"block_m": 128, "block_n": 64}), (5, 384, 64, {})])
def test_against_a_float64_product(m, n, k, cfg):
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
    got = f32_gemm.f32_gemm_triton(x, w, **cfg)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - want).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().t())).all()
    assert torch.allclose(got, f32_gemm.f32_gemm_reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("m, n, k, x_dtype, cfg", [(300, 384, 512, torch.float32, {}),
                                                    (70, 50, 200, torch.bfloat16, {"block_k": 64}),
                                                    (129, 130, 96, torch.float32, {"block_m": 128, "block_n": 64})])
def test_bf16_pass_on_bf16_values_is_a_float32_gemm(m, n, k, x_dtype, cfg, promote):
    """The bf16 pass on operands holding bf16 values (x as float32 or bf16, w bf16): exact products, float32
    sums, so within a float32 GEMM's bound of the float64 product; and tf32x3 within that of it. (How many bits
    the GPU's MMA keeps in its own sums, which `promote` avoids, the interpreter does not show: the kernel bench
    measures it.)"""
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).bfloat16().to(x_dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    got = f32_gemm.f32_gemm_triton(x, w, precision="bf16", promote=promote, **cfg)
    want = x.double() @ w.double().t()
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - want).abs() <= bound).all()
    assert ((got.double() - f32_gemm.f32_gemm_triton(x.float(), w.float(), **cfg).double()).abs() <= 2 * bound).all()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="do not fit"):
        f32_gemm.f32_gemm_triton(torch.zeros(4, 8), torch.zeros(3, 7))
    with pytest.raises(ValueError, match="precision"):
        f32_gemm.f32_gemm_triton(torch.zeros(4, 8), torch.zeros(3, 8), precision="fp16")
    assert f32_gemm.f32_gemm_triton(torch.zeros(0, 8), torch.zeros(3, 8)).shape == (0, 3)


def test_the_knob_sends_prefill_widths_to_the_kernel(monkeypatch):
    """TritonOps.f32_linear: with f32_tf32x3 (the default) a prefill's float32 GEMM is the kernel's, above the
    decode widths (which keep their K-split batched GEMM), in one bf16 pass where the weight holds bf16 values
    under `reference` (f32_one_pass); off, the wrapped op's."""
    import engine.ops.triton as kernel_ops
    from engine.ops import ops_for

    monkeypatch.setattr(kernel_ops, "checkpoint_backed", lambda weights: True)
    ops = kernel_ops.TritonOps(ops_for("reference"), type("W", (), {"reader": None})(), "cpu")
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, 512, generator=gen), torch.randn(384, 512, generator=gen)
    got = ops.f32_linear(x, w)
    assert ops.calls["f32_gemm"] == 1 and torch.allclose(got, x @ w.t(), rtol=1e-5, atol=1e-4)
    ops.f32_linear(x[:64], w)  # a decode step's width: the K-split form, not the kernel
    assert ops.calls["f32_gemm"] == 1
    assert ops.calls["f32_gemm_bf16"] == 0  # w's values are not all bf16: tf32x3
    w16, x16 = w.bfloat16().float(), x.bfloat16().float()  # a BF16-stored weight, as the gate's is: one bf16 pass
    assert torch.allclose(ops.f32_linear(x16, w16), x16 @ w16.t(), rtol=1e-5, atol=1e-4)
    assert ops.calls["f32_gemm"] == 2 and ops.calls["f32_gemm_bf16"] == 1
    ops.set_knobs("f32_one_pass=0")
    ops.f32_linear(x, w16)
    assert ops.calls["f32_gemm"] == 3 and ops.calls["f32_gemm_bf16"] == 1
    fp32 = kernel_ops.TritonOps(ops_for("fp32"), type("W", (), {"reader": None})(), "cpu")
    fp32.f32_linear(x, w16)  # activations not bf16 values under fp32: tf32x3
    assert fp32.calls["f32_gemm"] == 1 and fp32.calls["f32_gemm_bf16"] == 0
    ops.set_knobs("f32_tf32x3=0")
    assert torch.equal(ops.f32_linear(x, w), x @ w.t()) and ops.calls["f32_gemm"] == 3
