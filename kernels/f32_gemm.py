"""float32 x @ w^T on tensor cores at float32 accuracy, for the prefill's GEMMs the reference runs in float32 (the
router's gate [T, 5120] x [384, 5120]^T, a Full m > 1 layer's compressor projections): cuBLAS runs them on the
CUDA cores (sm80 FFMA sgemm: 0.33 ms for the gate at 4,096 tokens in run 18c's profile, ~50 TFLOP/s).

`tl.dot(..., input_precision="tf32x3")`: each operand split into its TF32 part and the float32 remainder, three
TF32 products (hi hi + hi lo + lo hi; lo lo, ~2^-22 of a product, left out), float32 accumulation. Float32 sums in
another order than cuBLAS's (as any other float32 GEMM's), so a top-6 routing near a tie may flip. A knob of TritonOps
(`f32_tf32x3`), on: 1.3x / 1.5x faster than cuBLAS float32 on the H200 (run 24a), 2.6e-7 from float64 where cuBLAS
is 3.9e-7 / 7.4e-7.

For operands whose values are all bf16 (the `reference` numerics' activations; the gate's and the compressor's
BF16-stored weights) tf32x3's lo pieces are zero and one pass gives its products, exact in float32:
`precision="bf16"`, one bf16 MMA a K step. Its sums: sm_90's MMA keeps fewer bits than float32 when it adds
products into its accumulator (H100 run 31b, 4096 x 384 x 5120 on bf16 values: one bf16 pass accumulating in the
MMA 5.6e-6 from float64, one TF32 pass 9.4e-6, tf32x3 2.4e-7), so each K step's product goes into a fresh
accumulator and is added to the running sum on the CUDA cores (`promote`, on by default; off: the MMA's own
accumulation, for the bench). tf32x3 owes its accuracy to the same: Triton's lowering adds each step's three
products to the running sum with a float32 add (its sm_90 TTGIR), so its MMA sums span one K step. Operands
with other values would be rounded: the caller's contract, not checked.

x [M, K], w [N, K] float32 (bf16 too under precision "bf16") -> float32 [M, N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import dot_dtype
from kernels.fp8_linear import _tile_rows


def _check(x, w):
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"float32 GEMM: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (x [M, K], w [N, K])")


def f32_gemm_reference(x, w, **_launch):
    """The engine's op (engine/ops/fp32.py f32_linear): a float32 matmul."""
    _check(x, w)
    return x.float() @ w.float().t()


@triton.jit
def _f32_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, one, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, PROMOTE: tl.constexpr):
    rm, rn = _tile_rows(M, N, BM, BN, GROUP)  # GROUP row blocks sweep the N blocks together (L2 reuse)
    rk = tl.arange(0, BK)
    xp = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    wp = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + rk) < K
        a = tl.load(xp + k0, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        b = tl.load(wp + k0, mask=(rn < N)[:, None] & kmask[None, :], other=0.0)
        if PREC == "bf16":  # bf16 values by contract: the cast is exact (DT: bf16 but under the interpreter)
            if PROMOTE:  # the step's sum in the MMA, the running sum in float32 on the CUDA cores; times a
                # runtime 1.0, or the compiler folds the add back into the MMA's accumulator (seen on triton 3.7)
                acc += tl.dot(a.to(DT), tl.trans(b.to(DT))) * one
            else:
                acc = tl.dot(a.to(DT), tl.trans(b.to(DT)), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


def f32_gemm_triton(x, w, block_m: int = 64, block_n: int | None = None, block_k: int | None = None,
                    num_warps: int = 4, num_stages: int | None = None, precision: str = "tf32x3",
                    promote: bool = True):
    """See the module docstring; one launch of ceil(M / block_m) x ceil(N / block_n) programs. None picks the
    H200's best by N for tf32x3 (run 24a, 4,096 x 5,120 in, against cuBLAS float32): 64 x 64 x 32 tiles, 3 stages
    up to N = 512 (the gate, N 384: 255 us against 310 for 64 x 128 and 337 for cuBLAS), 64 x 128 x 64, 2 stages
    above (the compressor, N 1,024: 559 us against 614 and 852); the bf16 pass 64 x 128 x 64 tiles in 3 stages (run
    31b's best for the gate without `promote`: 67.9 us)."""
    _check(x, w)
    if precision not in ("tf32x3", "ieee", "bf16"):
        raise ValueError(f"float32 GEMM: precision {precision!r} is not tf32x3, ieee or bf16")
    one_pass = precision == "bf16"
    if one_pass:  # float32 or bf16 tensors as they are, cast in the kernel
        x, w = x.contiguous(), w.contiguous()
    else:
        x, w = x.float().contiguous(), w.float().contiguous()
    m, k = x.shape
    n = w.shape[0]
    narrow = n <= 512 and not one_pass
    block_n = block_n or (64 if narrow else 128)
    block_k = block_k or (32 if narrow else 64)
    num_stages = num_stages or (3 if narrow or one_pass else 2)
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _f32_gemm_kernel[grid](x, w, out, m, n, k, 1.0, BM=block_m, BN=block_n, BK=block_k, GROUP=8, PREC=precision,
                               DT=dot_dtype(), PROMOTE=promote, num_warps=num_warps, num_stages=num_stages)
    return out
