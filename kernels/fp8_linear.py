"""FP8 block-scaled linear: y = x W^T with W E4M3 [N, K] + E8M0 per 32x32 block, and x quantized
on the fly to E4M3 with one E8M0 scale per 32 (kernels.quant, bit-exact with engine.quant).

x bf16 [M, K], w float8_e4m3fn [N, K], w_scale float8_e8m0fnu [ceil(N/32), K/32] -> bf16 [M, N].
Each 32-wide K step is one FP8 tensor-core product, promoted to float32 and scaled there (so the
tensor core's short accumulator never spans more than 32 products).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import e4m3_value, e8m0_value
from kernels.quant import quantize_fp8_triton


def _check(x, w, w_scale):
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or k % 32 or w_scale.shape != (-(-n // 32), k // 32):
        raise ValueError(f"FP8 linear: x {tuple(x.shape)}, w {tuple(w.shape)}, w_scale {tuple(w_scale.shape)} "
                         "do not fit (K a multiple of 32, scales [ceil(N/32), K/32])")
    return m, n, k


def fp8_linear_reference(x, w, w_scale):
    m, n, k = _check(x, w, w_scale)
    cdt = torch.float64 if x.device.type == "cpu" else torch.float32
    q, s = Q.quantize_fp8(x.cpu() if x.device.type != "cpu" else x)
    a = Q.dequantize_fp8(q, s).to(x.device, cdt)
    if x.device.type == "cpu":
        b = Q.dequantize_fp8_weight(w, w_scale).to(cdt)
    else:
        sb = w_scale.float().repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
        b = (w.float() * sb).to(cdt)
    return (a @ b.T).to(torch.bfloat16)


@triton.jit
def _fp8_linear_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                       BM: tl.constexpr, BN: tl.constexpr, NATIVE: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    # grouped order: neighbouring programs share B tiles in L2
    width = GROUP * n_n
    g = pid // width
    first_m = g * GROUP
    gsize = tl.minimum(n_m - first_m, GROUP)
    pm = first_m + (pid % width) % gsize
    pn = (pid % width) // gsize
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mm = rm < M
    nm = rn < N
    kk = tl.arange(0, 32)
    ks = K // 32
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, ks):
        k0 = kb * 32
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + (k0 + kk)[None, :], mask=mm[:, None], other=0)
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * K + (k0 + kk)[None, :], mask=nm[:, None], other=0)
        sa = e8m0_value(tl.load(as_ptr + rm.to(tl.int64) * ks + kb, mask=mm, other=127).to(tl.int32))
        sb = e8m0_value(tl.load(bs_ptr + (rn // 32) * ks + kb, mask=nm, other=127).to(tl.int32))
        if NATIVE:
            p = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b.to(tl.float8e4nv, bitcast=True)))
        else:
            p = tl.dot(e4m3_value(a.to(tl.int32)), tl.trans(e4m3_value(b.to(tl.int32))))
        acc += p * sa[:, None] * sb[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(tl.bfloat16),
             mask=mm[:, None] & nm[None, :])


def fp8_linear_triton(x, w, w_scale, block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                      num_stages: int = 4, native: bool | None = None):
    m, n, k = _check(x, w, w_scale)
    if native is None:
        native = x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"
    q, s = quantize_fp8_triton(x)
    bm = block_m if m > 64 else 64
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, block_n),)
    _fp8_linear_kernel[grid](q.view(torch.uint8), s.view(torch.uint8), w.contiguous().view(torch.uint8),
                             w_scale.contiguous().view(torch.uint8), out, m, n, k, BM=bm, BN=block_n,
                             NATIVE=native, GROUP=8, num_warps=num_warps, num_stages=num_stages)
    return out
