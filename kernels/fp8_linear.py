"""FP8 block-scaled linear: y = x W^T with W E4M3 [N, K] + E8M0 per 32x32 block, and x quantized
on the fly to E4M3 with one E8M0 scale per 32 (kernels.quant, bit-exact with engine.quant).

x bf16 [M, K], w float8_e4m3fn [N, K], w_scale float8_e8m0fnu [ceil(N/32), K/32] -> bf16 [M, N].
Two forms (`mma`):
- "fp8": each 32-wide K step is one FP8 tensor-core product, promoted to float32 and scaled there (so the
  tensor core's short accumulator never spans more than 32 products). With a scale every 32 of K that
  rescale costs as much CUDA-core time as the FP8 MMA of the step (H200: 215 TFLOP/s at 4096x5120x8192).
- "bf16": bf16 tensor-core products of exact values, no rescale in the K loop: x as the bf16 values of its
  E4M3 round trip (E4M3 value * 2^e is a bf16), the weight tile decoded in registers from its bytes to bf16
  with its block scale folded in, one bf16 dot per BK (64 or 128) of K into the float32 accumulator. Every
  product is exact and sums are float32, as in the FP8 form; the weight stays in its FP8 bytes.
- "cublas" (a prefill's widths): the bf16 form's products by cuBLAS: the weight's exact bf16 values made for the
  call (`fp8_weight_bf16`, one launch; transient, the stored bytes stay the weight) and one bf16 GEMM with float32
  sums, its output rounded to bf16 by cuBLAS. The same values and roundings as the bf16 form, another order of sums.
Decode-sized products (<= 64 rows) split K over more programs (`fp8_linear_plan`) and add the float32
partials in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import (bf16_output, dot_dtype, e4m3_rounded, e4m3_value, e8m0_bf16_factor, e8m0_bytes_at_most,
                              e8m0_value, in_mma_k_order, interpreted, sm_count)
from kernels.quant import fp8_groups, quantize_fp8_triton

# the bf16 form folds 2^(s - 127) into the weight's bf16 value as one factor 2^(s - 7) (_formats.e8m0_bf16_factor
# at offset 120), a bf16 while s <= 134 (weights up to 448 * 2^7); products stay exact down to s = 3
BF16_FACTOR_OFFSET = 120
BF16_MAX_SCALE_BYTE = 254 - BF16_FACTOR_OFFSET
_BF16_FACTOR_OFFSET = tl.constexpr(BF16_FACTOR_OFFSET)  # a jit function reads module globals only as constexpr


def _check(x, w, w_scale):
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or k % 32 or w_scale.shape != (-(-n // 32), k // 32):
        raise ValueError(f"FP8 linear: x {tuple(x.shape)}, w {tuple(w.shape)}, w_scale {tuple(w_scale.shape)} "
                         "do not fit (K a multiple of 32, scales [ceil(N/32), K/32])")
    return m, n, k


def fp8_linear_reference(x, w, w_scale, float_out: bool = False, mma: str = "fp8", x_values=None):
    """x [M, K] (quantized to E4M3 per 32 here) @ the dequantized weight^T in float64 (float32 off the CPU)
    -> bf16 [M, N] (float_out: those values as float32). mma: the kernel's form, the same products for both;
    x_values: the kernel's reuse of x's rounded values (the same values: ignored here)."""
    del mma, x_values
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
def _tile_rows(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """This program's output rows and columns; grouped order: neighbouring programs share B tiles in L2."""
    pid = tl.program_id(0)
    width = GROUP * tl.cdiv(N, BN)
    first_m = (pid // width) * GROUP
    gsize = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP)
    pm = first_m + (pid % width) % gsize
    pn = (pid % width) // gsize
    return pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN)


@triton.jit
def _store_tile(acc, c_ptr, rm, rn, M, N, PARTIAL: tl.constexpr):
    """The tile's float32 sums [BM, BN]: as float32 into this split's slice of c [splits, M, N] (PARTIAL), else
    as c's bf16 values into c [M, N]."""
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if PARTIAL:
        tl.store(c_ptr + tl.program_id(1).to(tl.int64) * M * N + offs, acc, mask=mask)
    else:
        tl.store(c_ptr + offs, bf16_output(acc, c_ptr), mask=mask)


@triton.jit
def _fp8_linear_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, STEPS,
                       BM: tl.constexpr, BN: tl.constexpr, NATIVE: tl.constexpr, GROUP: tl.constexpr,
                       PARTIAL: tl.constexpr):
    """Program (tile, split): the tile's sum over K steps [split * STEPS, (split + 1) * STEPS) of 32.
    PARTIAL: stored as float32 into split's slice of c [splits, M, N]; else as bf16 into c [M, N]."""
    rm, rn = _tile_rows(M, N, BM, BN, GROUP)
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
    _store_tile(acc, c_ptr, rm, rn, M, N, PARTIAL)


@triton.jit
def _x_values_bf16_kernel(x_ptr, y_ptr, n_groups, BLOCK: tl.constexpr, BG: tl.constexpr):
    """x's E4M3 round trip (kernels.quant's codes and scales) as bf16 values, each 64-wide K block in the
    MMA K order (kernels/_formats.py in_mma_k_order). Exact: an E4M3 value (4 significant bits) times 2^e,
    e >= -22 (the quantizer's amax floor 1e-4), is a bf16 wherever it is a finite float32 (the same exponent
    range)."""
    v, scale, offs, g, gmask = fp8_groups(x_ptr, BLOCK, BG, n_groups)
    # K rows are whole 64 blocks, so groups pair up; reordered in registers, stored whole (a scattered
    # store of the same values took 256 us at 4096 x 8192 on the H200)
    v = in_mma_k_order(tl.reshape(e4m3_rounded(v) * scale[:, None], (BG // 2, 2 * BLOCK)), 2 * BLOCK)
    blk = tl.program_id(0) * (BG // 2) + tl.arange(0, BG // 2)
    tl.store(y_ptr + blk.to(tl.int64)[:, None] * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)[None, :], v.to(tl.bfloat16),
             mask=(blk < n_groups // 2)[:, None])


def x_values_bf16(x: torch.Tensor) -> torch.Tensor:
    """dequantize_fp8(*quantize_fp8(x)) as bf16 [M, K] (the same values: the cast is exact), one launch; K a
    multiple of 64, each 64 block in the MMA K order (in_mma_k_order)."""
    if x.shape[-1] % 64:
        raise ValueError(f"x's last dimension {x.shape[-1]} is not a multiple of 64")
    xc = x.contiguous()
    y = torch.empty(xc.shape, dtype=torch.bfloat16, device=x.device)
    n_groups = xc.numel() // 32
    if n_groups:
        _x_values_bf16_kernel[(triton.cdiv(n_groups, 64),)](xc, y, n_groups, BLOCK=32, BG=64)
    return y


# E4M3 bytes -> bf16 worth value * 2^-120, times a bf16 factor: per byte pair, the two bytes into the high bytes
# of the bf16 halves (prmt), the 7 magnitude bits down 4 (exponent and mantissa line up; E4M3 subnormals land
# on bf16 subnormals), the sign kept, then one bf16x2 multiply. Four bytes in $2, factors in $3 $4.
E4M3_BF16_SCALED_PTX = """
{
.reg .b32 t<2>, u<2>;
prmt.b32 t0, $2, 0, 0x1404;
prmt.b32 t1, $2, 0, 0x3424;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
and.b32 u0, u0, 0x07F007F0;
and.b32 u1, u1, 0x07F007F0;
and.b32 t0, t0, 0x80008000;
and.b32 t1, t1, 0x80008000;
or.b32 t0, t0, u0;
or.b32 t1, t1, u1;
mul.rn.bf16x2 $0, t0, $3;
mul.rn.bf16x2 $1, t1, $4;
}
"""
_E4M3_BF16_SCALED_ASM = tl.constexpr(E4M3_BF16_SCALED_PTX)


@triton.jit
def e4m3_scaled_operand(byte, sbyte, BK: tl.constexpr, DT: tl.constexpr):
    """E4M3 bytes [R, BK] (uint8) times 2^(s - 127), s the E8M0 bytes [R, BK/32] (int32) of their 32-wide
    K blocks, as a DT dot operand, exact. bf16: E4M3_BF16_SCALED_PTX with the factor 2^(s - 7); a byte
    s > BF16_MAX_SCALE_BYTE makes the factor NaN, so a weight out of the form's range shows in the output
    instead of being wrong. float32 (the interpreter, which runs no PTX and whose bf16 dots are not
    usable): the value decoders."""
    R: tl.constexpr = byte.shape[0]
    if DT == tl.bfloat16:
        f = e8m0_bf16_factor(sbyte, _BF16_FACTOR_OFFSET)
        f = tl.reshape(tl.broadcast_to(f[:, :, None], (R, BK // 32, 32)), (R, BK))
        return tl.inline_asm_elementwise(_E4M3_BF16_SCALED_ASM, "=r,=r,r,r,r", [byte, f], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)
    else:
        f = tl.reshape(tl.broadcast_to(e8m0_value(sbyte)[:, :, None], (R, BK // 32, 32)), (R, BK))
        return e4m3_value(byte.to(tl.int32)) * f


@triton.jit
def _weight_tile(b_rows, s_rows, nm, k0, BK: tl.constexpr, DT: tl.constexpr):
    """The weight's K columns [k0, k0 + BK) of the rows at b_rows (their E4M3 bytes) and s_rows (their 32x32 blocks'
    E8M0 bytes), masked by nm: exact DT values in the MMA K order (`in_mma_k_order`, x_values_bf16's)."""
    b = tl.load(b_rows + (k0 + tl.arange(0, BK))[None, :], mask=nm[:, None], other=0)
    sb = tl.load(s_rows + (k0 // 32 + tl.arange(0, BK // 32))[None, :], mask=nm[:, None], other=127)
    return in_mma_k_order(e4m3_scaled_operand(b, sb.to(tl.int32), BK, DT), BK)


@triton.jit
def _fp8_linear_bf16_kernel(a_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, STEPS,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                            GROUP: tl.constexpr, PARTIAL: tl.constexpr):
    """The bf16 form. Program (tile, split): the tile's sum over K steps [split * STEPS, (split + 1) * STEPS)
    of BK (K a multiple of BK); a: x's bf16 values [M, K] from `x_values_bf16`, in the MMA's K order, which
    the weight tile takes in registers (`in_mma_k_order`). The decoded weight tile is the dot's left
    operand, so it can feed the tensor core from registers (a Hopper wgmma takes its A operand there, B
    only from shared memory): acc is the output tile transposed, [BN, BM]. PARTIAL as in
    _fp8_linear_kernel."""
    rm, rn = _tile_rows(M, N, BM, BN, GROUP)
    mm = rm < M
    nm = rn < N
    kk = tl.arange(0, BK)
    split = tl.program_id(1)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * K
    b_rows = b_ptr + rn[:, None].to(tl.int64) * K
    s_rows = bs_ptr + (rn // 32)[:, None] * (K // 32)
    acc = tl.zeros([BN, BM], tl.float32)
    for kb in range(split * STEPS, tl.minimum(K // BK, (split + 1) * STEPS)):
        k0 = kb * BK
        a = tl.load(a_rows + (k0 + kk)[None, :], mask=mm[:, None], other=0.0)
        acc = tl.dot(_weight_tile(b_rows, s_rows, nm, k0, BK, DT), tl.trans(a.to(DT)), acc)
    _store_tile(tl.trans(acc), c_ptr, rm, rn, M, N, PARTIAL)


@triton.jit
def _weight_bf16_kernel(w_ptr, s_ptr, out_ptr, N, K, BR: tl.constexpr, DT: tl.constexpr):
    """Program (row block, 64-wide K block): the weight's values E4M3 * 2^(s - 127) as bf16, in the MMA K order of
    x_values_bf16 (in_mma_k_order); a scale byte past BF16_MAX_SCALE_BYTE gives NaN, as in the bf16 form."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    k0 = tl.program_id(1) * 64
    rm = rows < N
    v = _weight_tile(w_ptr + rows.to(tl.int64)[:, None] * K, s_ptr + (rows // 32)[:, None] * (K // 32), rm, k0, 64, DT)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + (k0 + tl.arange(0, 64))[None, :], v.to(tl.bfloat16),
             mask=rm[:, None])


def fp8_weight_bf16(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The dequantized weight [N, K] as bf16 (exact), each 64 block of K in the MMA K order (x_values_bf16's), one
    launch; K a multiple of 64, scale bytes up to BF16_MAX_SCALE_BYTE (past it: NaN, see bf16_form_fits)."""
    n, k = w.shape
    if k % 64 or w_scale.shape != (-(-n // 32), k // 32):
        raise ValueError(f"FP8 weight {tuple(w.shape)} with scales {tuple(w_scale.shape)}: K must be a multiple of "
                         "64 and the scales [ceil(N/32), K/32]")
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    if n:
        _weight_bf16_kernel[(triton.cdiv(n, 32), k // 64)](w.contiguous().view(torch.uint8),
                                                          w_scale.contiguous().view(torch.uint8), out, n, k, BR=32,
                                                          DT=dot_dtype())
    return out


def bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> bf16 [M, N] for bf16 a, b: float32 sums of the exact products, rounded to bf16 once
    (cuBLAS on the GPU, with its bf16 partial reductions off for the call)."""
    if not a.is_cuda:
        return (a.float() @ b.float().t()).bfloat16()
    cuda = torch.backends.cuda.matmul
    reduced = cuda.allow_bf16_reduced_precision_reduction
    cuda.allow_bf16_reduced_precision_reduction = False
    try:
        return a @ b.t()
    finally:
        cuda.allow_bf16_reduced_precision_reduction = reduced


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
                    split_k: int | None = None, waves: float = 2.0, block_k: int = 32) -> tuple[int, int, int, int]:
    """(BM, BN, K steps of block_k per split, splits). The bf16 form (block_k > 32) takes 128 x 256 tiles
    (sm_90 compile: 239 registers, no spill, wgmmas not serialized, unlike 128 x 128's). Up to 64 rows (a
    decode step) the tiles are 64 x 128 (the bf16 form: 16 to 64 rows, the rows' power of two: its x rows
    are the MMA's N, which may be small) and K is split until at least `waves` programs per SM run:
    without it a 64 x 5120 x 8192 product is 40 programs walking 256 K steps each. H200, run 13, against
    that launch: 129.5 -> 35.7 us (wo_b), 72.4 -> 13.1-14.1 (wq_a), 72.6 -> 16.0 (shared expert), 31.1 ->
    28.9 (wq_b); 64 x 64 tiles were slower on three of the four. Each split's partial sums are added in a
    fixed order, so the result does not depend on the split's timing."""
    small = m <= 64
    bf16 = block_k > 32
    bm = (min(64, max(16, triton.next_power_of_2(m))) if bf16 else 64) if small else block_m
    bn = block_n if block_n is not None else (256 if bf16 and not small else 128)
    ks = triton.cdiv(k, block_k)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split_k is None:
        # rounded up: 200 tiles (the Engram's wkv, N = 25600) get 2 splits, not 1 -- 1.5 programs an SM
        # kept 1.3 TB/s in flight (123 us for 157 MB, H200 run 15c)
        split_k = max(1, -(-int(waves * sm_count(device)) // tiles)) if small else 1
    steps = triton.cdiv(ks, max(1, min(int(split_k), ks)))
    return bm, bn, steps, triton.cdiv(ks, steps)


def fp8_linear_triton(x, w, w_scale, block_m: int = 128, block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int = 4, native: bool | None = None, split_k: int | None = None,
                      waves: float = 2.0, float_out: bool = False, mma: str = "fp8", block_k: int = 64,
                      x_values: torch.Tensor | None = None):
    """x [M, K] @ dequant(w)^T -> bf16 [M, N] (float_out: its bf16 values as float32, rounded to nearest
    even in the kernel: what the reference numerics store, without a widening copy); the launch shape from
    `fp8_linear_plan` (num_warps: 8 for 128 x 128 tiles, 4 for the 64-row tiles of a decode step).
    mma: "fp8" (the FP8 tensor-core form, 32 of K per step) or "bf16" (bf16 products of the exact values,
    block_k of K per step (64 where it does not divide K, a multiple of 64); weight scale bytes above
    BF16_MAX_SCALE_BYTE give NaN, see `bf16_form_fits`), or "cublas" (the bf16 form's products through
    `fp8_weight_bf16` and `bf16_gemm`; the launch knobs do not apply). x_values (bf16 form): `x_values_bf16(x)` made
    already, for linears that share an input (the attention's wq_a and wkv, the shared expert's w1 and w3)."""
    m, n, k = _check(x, w, w_scale)
    if mma not in ("fp8", "bf16", "cublas"):
        raise ValueError(f"FP8 linear: unknown mma form {mma!r} (fp8, bf16 or cublas)")
    if x_values is not None and (x_values.shape != x.shape or x_values.dtype != torch.bfloat16):
        raise ValueError(f"FP8 linear: x_values {tuple(x_values.shape)} {x_values.dtype} are not x's bf16 values")
    if mma == "cublas":  # K's multiple of 64 checked by fp8_weight_bf16
        y = bf16_gemm(x_values_bf16(x) if x_values is None else x_values, fp8_weight_bf16(w, w_scale))
        return y.float() if float_out else y
    bf16 = mma == "bf16"
    if bf16 and (block_k not in (64, 128, 256) or k % 64):
        raise ValueError(f"FP8 linear, bf16 form: block_k {block_k} is not 64, 128 or 256, or K = {k} is not a "
                         "multiple of 64")
    if native is None:
        native = x.is_cuda and not interpreted()
    out = torch.empty(m, n, dtype=torch.float32 if float_out else torch.bfloat16, device=x.device)
    if m == 0 or n == 0:
        return out
    bk = (block_k if k % block_k == 0 else 64) if bf16 else 32
    bm, bn, steps, splits = fp8_linear_plan(m, n, k, x.device, block_m, block_n, split_k, waves, bk)
    nw = num_warps if num_warps is not None else (8 if bm * bn >= 128 * 128 else 4)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), splits)
    if bf16:
        _fp8_linear_bf16_kernel[grid](x_values_bf16(x) if x_values is None else x_values.contiguous(),
                                      w.contiguous().view(torch.uint8),
                                      w_scale.contiguous().view(torch.uint8), part, m, n, k, steps, BM=bm, BN=bn,
                                      BK=bk, DT=dot_dtype(), GROUP=8, PARTIAL=splits > 1,
                                      num_warps=nw, num_stages=num_stages)
    else:
        q, s = quantize_fp8_triton(x)
        _fp8_linear_kernel[grid](q.view(torch.uint8), s.view(torch.uint8), w.contiguous().view(torch.uint8),
                                 w_scale.contiguous().view(torch.uint8), part, m, n, k, steps, BM=bm, BN=bn,
                                 NATIVE=native, GROUP=8, PARTIAL=splits > 1, num_warps=nw, num_stages=num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLITS=splits, BLOCK=block, num_warps=4)
    return out


def bf16_form_fits(w_scale: torch.Tensor) -> bool:
    """Whether every weight scale byte is in the bf16 form's range (<= BF16_MAX_SCALE_BYTE, a weight up to
    448 * 2^7): a check for load time (it syncs), the kernel itself writes NaN for a block out of range."""
    return e8m0_bytes_at_most(BF16_MAX_SCALE_BYTE, w_scale)
