"""FP8 block-scaled linear: y = x W^T with W E4M3 [N, K] + E8M0 per 32x32 block, and x quantized
on the fly to E4M3 with one E8M0 scale per 32 (kernels.quant, bit-exact with engine.quant).

x bf16 [M, K], w float8_e4m3fn [N, K], w_scale float8_e8m0fnu [ceil(N/32), K/32] -> bf16 [M, N].
Each 32-wide K step is one FP8 tensor-core product, promoted to float32 and scaled there (so the
tensor core's short accumulator never spans more than 32 products). Decode-sized products (<= 64 rows)
split K over more programs (`fp8_linear_plan`) and add the float32 partials in a fixed order.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import bf16_output, e4m3_value, e8m0_value, sm_count
from kernels.quant import quantize_fp8_triton


def _check(x, w, w_scale):
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or k % 32 or w_scale.shape != (-(-n // 32), k // 32):
        raise ValueError(f"FP8 linear: x {tuple(x.shape)}, w {tuple(w.shape)}, w_scale {tuple(w_scale.shape)} "
                         "do not fit (K a multiple of 32, scales [ceil(N/32), K/32])")
    return m, n, k


def fp8_linear_reference(x, w, w_scale, float_out: bool = False):
    """x [M, K] (quantized to E4M3 per 32 here) @ the dequantized weight^T in float64 (float32 off the CPU)
    -> bf16 [M, N] (float_out: those values as float32)."""
    m, n, k = _check(x, w, w_scale)
    cdt = torch.float64 if x.device.type == "cpu" else torch.float32
    q, s = Q.quantize_fp8(x.cpu() if x.device.type != "cpu" else x)
    a = Q.dequantize_fp8(q, s).to(x.device, cdt)
    if x.device.type == "cpu":
        b = Q.dequantize_fp8_weight(w, w_scale).to(cdt)
    else:
        sb = w_scale.float().repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
        b = (w.float() * sb).to(cdt)
    out = (a @ b.T).to(torch.bfloat16)
    return out.float() if float_out else out


@triton.jit
def _fp8_linear_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, STEPS,
                       BM: tl.constexpr, BN: tl.constexpr, NATIVE: tl.constexpr, GROUP: tl.constexpr,
                       PARTIAL: tl.constexpr):
    """Program (tile, split): the tile's sum over K steps [split * STEPS, (split + 1) * STEPS) of 32.
    PARTIAL: stored as float32 into split's slice of c [splits, M, N]; else as bf16 into c [M, N]."""
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
    split = tl.program_id(1)
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(split * STEPS, tl.minimum(ks, (split + 1) * STEPS)):
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
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    if PARTIAL:
        tl.store(c_ptr + split.to(tl.int64) * M * N + offs, acc, mask=mm[:, None] & nm[None, :])
    else:
        tl.store(c_ptr + offs, bf16_output(acc, c_ptr), mask=mm[:, None] & nm[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, c_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """c = bf16(sum of the float32 partials [SPLITS, MN]), added in split order (deterministic); a float32 c
    holds those bf16 values."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * MN + i, mask=mask, other=0.0)
    tl.store(c_ptr + i, bf16_output(acc, c_ptr), mask=mask)


def fp8_linear_plan(m: int, n: int, k: int, device, block_m: int = 128, block_n: int | None = None,
                    split_k: int | None = None, waves: float = 2.0) -> tuple[int, int, int, int]:
    """(BM, BN, K steps per split, splits). Up to 64 rows (a decode step) the tiles are 64 x 128 and K
    is split until at least `waves` programs per SM run: without it a 64 x 5120 x 8192 product is 40
    programs walking 256 K steps each. H200, run 13, against that launch: 129.5 -> 35.7 us (wo_b),
    72.4 -> 13.1-14.1 (wq_a), 72.6 -> 16.0 (shared expert), 31.1 -> 28.9 (wq_b); 64 x 64 tiles were
    slower on three of the four. Each split's partial sums are added in a fixed order, so the result does
    not depend on the split's timing."""
    small = m <= 64
    bm = 64 if small else block_m
    bn = block_n if block_n is not None else 128
    ks = k // 32
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split_k is None:
        # rounded up: 200 tiles (the Engram's wkv, N = 25600) get 2 splits, not 1 -- 1.5 programs an SM
        # kept 1.3 TB/s in flight (123 us for 157 MB, H200 run 15c)
        split_k = max(1, -(-int(waves * sm_count(device)) // tiles)) if small else 1
    steps = triton.cdiv(ks, max(1, min(int(split_k), ks)))
    return bm, bn, steps, triton.cdiv(ks, steps)


def fp8_linear_triton(x, w, w_scale, block_m: int = 128, block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int = 4, native: bool | None = None, split_k: int | None = None,
                      waves: float = 2.0, float_out: bool = False):
    """x [M, K] @ dequant(w)^T -> bf16 [M, N] (float_out: its bf16 values as float32, rounded to nearest
    even in the kernel: what the reference numerics store, without a widening copy); the launch shape from
    `fp8_linear_plan` (num_warps: 8 for 128 x 128 tiles, 4 for the 64-row tiles of a decode step)."""
    m, n, k = _check(x, w, w_scale)
    if native is None:
        native = x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"
    out = torch.empty(m, n, dtype=torch.float32 if float_out else torch.bfloat16, device=x.device)
    if m == 0 or n == 0:
        return out
    q, s = quantize_fp8_triton(x)
    bm, bn, steps, splits = fp8_linear_plan(m, n, k, x.device, block_m, block_n, split_k, waves)
    nw = num_warps if num_warps is not None else (8 if bm * bn >= 128 * 128 else 4)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), splits)
    _fp8_linear_kernel[grid](q.view(torch.uint8), s.view(torch.uint8), w.contiguous().view(torch.uint8),
                             w_scale.contiguous().view(torch.uint8), part, m, n, k, steps, BM=bm, BN=bn,
                             NATIVE=native, GROUP=8, PARTIAL=splits > 1, num_warps=nw, num_stages=num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLITS=splits, BLOCK=block, num_warps=4)
    return out
