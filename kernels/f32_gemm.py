"""float32 x @ w^T on tensor cores at float32 accuracy, for the prefill's GEMMs the reference runs in float32 (the
router's gate [T, 5120] x [384, 5120]^T, a Full m > 1 layer's compressor projections): cuBLAS runs them on the
CUDA cores (sm80 FFMA sgemm: 0.33 ms for the gate at 4,096 tokens in run 18c's profile, ~50 TFLOP/s).

`tl.dot(..., input_precision="tf32x3")`: each operand split into its TF32 part and the float32 remainder, three
TF32 products (hi hi + hi lo + lo hi; lo lo, ~2^-22 of a product, left out), float32 accumulation. Float32 sums in
another order than cuBLAS's (as any other float32 GEMM's), so a top-6 routing near a tie may flip: a knob of
TritonOps (`f32_tf32x3`), off until timed on the GPU with its routing parity.

x [M, K], w [N, K] float32 -> float32 [M, N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_linear import _tile_rows


def _check(x, w):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"float32 GEMM: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (x [M, K], w [N, K])")


def f32_gemm_reference(x, w, **_launch):
    """The engine's op (engine/ops/fp32.py f32_linear): a float32 matmul."""
    _check(x, w)
    return x.float() @ w.float().t()


@triton.jit
def _f32_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP: tl.constexpr, PREC: tl.constexpr):
    rm, rn = _tile_rows(M, N, BM, BN, GROUP)  # GROUP row blocks sweep the N blocks together (L2 reuse)
    rk = tl.arange(0, BK)
    xp = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    wp = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + rk) < K
        a = tl.load(xp + k0, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        b = tl.load(wp + k0, mask=(rn < N)[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


def f32_gemm_triton(x, w, block_m: int = 64, block_n: int = 128, block_k: int = 32, num_warps: int = 4,
                    num_stages: int = 3, precision: str = "tf32x3"):
    """See the module docstring; one launch of ceil(M / block_m) x ceil(N / block_n) programs."""
    _check(x, w)
    if precision not in ("tf32x3", "ieee"):
        raise ValueError(f"float32 GEMM: precision {precision!r} is not tf32x3 or ieee")
    x, w = x.float().contiguous(), w.float().contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _f32_gemm_kernel[grid](x, w, out, m, n, k, BM=block_m, BN=block_n, BK=block_k, GROUP=8, PREC=precision,
                               num_warps=num_warps, num_stages=num_stages)
    return out
