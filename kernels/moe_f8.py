"""FP4 routed experts on FP8 tensor cores: the grouped GEMMs of kernels/moe.py with E4M3 operands.

The activations entering an FP4 GEMM are E4M3 with an E8M0 scale per 32 (ARCHITECTURE.md section 3;
engine/model/moe.py: `linear(x, None)` before the gate/up GEMM, `linear(act(h * w), None)` before the
down GEMM), and an E2M1 value is an E4M3 value: so both operands go to the tensor cores as E4M3 bytes
and each 32-wide K group's product is scaled by its two E8M0 scales in the fp32 accumulator.

Against the bf16 form (kernels/moe.py), per weight value: no bf16 multiplies (the scale moves from the
weight tile to the group's [rows, tokens] partial sums), one byte instead of two through shared memory on
the way to the MMA operand, and an FP8 MMA of twice the bf16 rate. The E2M1 -> E4M3 decode is bit
placement: nibble s e1 e0 m -> byte s 0 0 e1 e0 m 0 0, the E4M3 value of E2M1 value * 2^-6 (E2M1's
subnormal 0.5 lands on E4M3's subnormal 2^-7), so the weight's scale carries 2^6 back
(`_formats.e2m1_as_e4m3`: four bytes in seven 32-bit operations of inline PTX on the GPU). K runs in HALVES
order inside each group (even K, then odd: the decoded bytes' own order); x is permuted once on the host
and h is stored so. The scale bytes come through inline PTX loads (`scale_bytes_at`), which keep the
accumulator's layout.

Numerics are the engine's (engine/model/moe.py; `reference`, or `fp32` without the bf16 roundings): gate
and up rounded to bf16 before the SwiGLU, w * h rounded to bf16 and quantized to E4M3 per 32 (bit for bit
as engine.quant), each expert's output rounded to bf16 before the sum over a token's experts. What differs
is the order of sums, and the FP8 MMA's accumulation inside one 32-wide group: rel 1.6e-3 against the
float32 reference (H200 runs 16c, 17a), where the bf16 form with the same numerics is at 2.6e-4. That is
the QGMMA's own precision, not this kernel's: at 8-token blocks Triton (3.6, 3.7) cannot use a warpgroup
MMA and emits `mma.sync.m16n8k16.f16` on the bytes widened to f16 (exact products, fp32 sums; sm_90 PTX,
checked without a GPU): 1.5e-4 there, and 2.4x slower. Measured faster than the bf16 form only at the
decode step's widths (kernels/moe.py fp8_form_pays).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import (bf16_rne_bits, e2m1_as_e4m3, e4m3_code, e4m3_operand, e4m3_rounded, e4m3_value,
                              pow2_scale_up)


@triton.jit
def scale_bytes_at(ptrs, ASM: tl.constexpr):
    """The E8M0 bytes at ptrs (uint8 pointers), int32. On the GPU as inline PTX loads, which keep the
    pointers' layout (the accumulator's slices): tl.load's coalesced layout cost a shared-memory round trip
    with two barriers per group to reach the accumulator's layout (sm_90 SASS)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs).to(tl.int32)


@triton.jit
def weight_group(wb_ptr, s_ptr, rows64, kg, KDIM: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """One 32-wide K group (from kg) of rows (all valid) of an FP4 weight (uint8 [N, KDIM/2], E8M0
    [N, KDIM/32]): the [R, 32] E4M3 operand (K in HALVES order) and the group's scale times 2^6, float32
    [R], exact for scale bytes up to 248 (2^121)."""
    j = tl.arange(0, 16)
    b = tl.load(wb_ptr + rows64[:, None] * (KDIM // 2) + (kg // 2 + j)[None, :])
    lo, hi = e2m1_as_e4m3(b, ASM)
    # K in HALVES order: position 16 half + j holds K 2 j + half (byte j's low nibble in the first half)
    tile = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (rows64.shape[0], 32))
    sb = scale_bytes_at(s_ptr + rows64 * (KDIM // 32) + kg // 32, ASM)
    scale = ((sb + 6) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127) * 2^6
    return e4m3_operand(tile, DT == tl.float8e4nv), scale


@triton.jit
def halves_position(k):
    """Column of K index k in HALVES order: within each 32-group, position 16 (k & 1) + (k & 31) / 2."""
    return (k & -32) | ((k & 1) << 4) | ((k & 31) >> 1)


def halves_order(a: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K] in HALVES order (the decoded weight groups' K order: even K first, then odd)."""
    r, kdim = a.shape
    return a.reshape(r, kdim // 32, 16, 2).transpose(-1, -2).reshape(r, kdim)


@triton.jit
def act_group(a_ptr, s_ptr, rows64, kg, KDIM: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """One 32-wide K group of an E4M3 activation (float8_e4m3fn [rows, KDIM] for an FP8 DT, else its bytes;
    E8M0 [rows, KDIM/32]; rows all valid): the [R, 32] operand and the group's scales, float32 [R] (scale
    bytes from 1: the quantizer's never go below 2^-22). Loaded as FP8, not as
    bytes cast in registers: so the tile goes straight to the MMA's shared layout (a byte tile cast in
    registers took a shared-memory round trip and a fence per group)."""
    k = kg + tl.arange(0, 32)
    a = tl.load(a_ptr + rows64[:, None] * KDIM + k[None, :])
    sb = scale_bytes_at(s_ptr + rows64 * (KDIM // 32) + kg // 32, ASM)
    if DT != tl.float8e4nv:
        a = e4m3_operand(a, False)
    return a, (sb << 23).to(tl.float32, bitcast=True)


@triton.jit
def act(v, RB: tl.constexpr):
    """An activation as the numerics store it: rounded to bf16 (RB: `reference`) or kept (`fp32`); the bit form
    (see `bf16_rne_bits`)."""
    if RB:
        return bf16_rne_bits(v).to(tl.float32)
    else:
        return v


@triton.jit
def _swiglu_groups(acc1, acc3, tw, limit, BN: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr):
    """act(w * SwiGLU(act(gate), act(up))) from gate and up sums acc1, acc3 [BN rows of I, BM pairs] and the
    pairs' routing weights tw [BM], in groups of 32 consecutive rows [BN/32, 32, BM] over each group's E8M0
    scale (engine.quant.quantize_fp8's), clamped to E4M3's range; and the scales [BN/32, BM]."""
    g = tl.minimum(act(acc1, RB), limit)  # clamped as engine/model/moe.py swiglu
    u = tl.minimum(tl.maximum(act(acc3, RB), -limit), limit)
    h = act(g / (1.0 + tl.exp(-g)) * u * tw[None, :], RB)
    hg = tl.reshape(h, (BN // 32, 32, BM))
    scale = pow2_scale_up(tl.maximum(tl.max(tl.abs(hg), axis=1), 1e-4), 1.0 / 448.0)  # [BN/32, BM]
    return tl.minimum(tl.maximum(tl.div_rn(hg, tl.broadcast_to(scale[:, None, :], hg.shape)), -448.0), 448.0), scale


@triton.jit
def swiglu_e4m3(acc1, acc3, tw, limit, BN: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr):
    """The engine's hidden state (`_swiglu_groups`) quantized to E4M3 with an E8M0 scale per 32 consecutive
    rows, as engine.quant.quantize_fp8 -> (E4M3 codes int32 [BN, BM], scales float32 [BN/32, BM])."""
    v, scale = _swiglu_groups(acc1, acc3, tw, limit, BN, BM, RB)
    return tl.reshape(e4m3_code(v), (BN, BM)), scale


@triton.jit
def swiglu_e4m3_values(acc1, acc3, tw, limit, BN: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr):
    """`swiglu_e4m3`'s hidden state as float32 values [BN, BM] (E4M3 value times its scale: exact in bf16),
    for the bf16 form, whose down GEMM takes h so: the values rounded on the float's bits (e4m3_rounded), no
    byte made and decoded back (the epilogue that spilled 508 bytes at 64 x 128 tiles on triton 3.6)."""
    v, scale = _swiglu_groups(acc1, acc3, tw, limit, BN, BM, RB)
    return tl.reshape(e4m3_rounded(v) * scale[:, None, :], (BN, BM))


@triton.jit
def _block(bexp_ptr, bbeg_ptr, bend_ptr, order_ptr, NBM, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           GROUP_M: tl.constexpr):
    """This program's expert e (< 0: nothing to do), its BM pairs' sorted rows (padding: the first row
    again) and their mask, the pair ids, and its BN rows of the expert's N-row weight: their indices, mask
    and global rows (past N: the last row, read and never stored)."""
    pid = tl.program_id(0)
    per_group = GROUP_M * ((N + BN - 1) // BN)  # GROUP_M token blocks sweep all N blocks together (kernels/moe.py)
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(NBM - first, GROUP_M)
    mb = first + (pid % per_group) % size
    nb = (pid % per_group) // size
    e = tl.load(bexp_ptr + mb)
    begin = tl.load(bbeg_ptr + mb)
    rows = begin + tl.arange(0, BM)
    rmask = rows < tl.load(bend_ptr + mb)
    rows = tl.where(rmask, rows, begin)  # padding columns repeat the first pair: read, computed, never stored
    n_idx = nb * BN + tl.arange(0, BN)
    grow = e.to(tl.int64) * N + tl.minimum(n_idx, N - 1)
    return e, rows, rmask, tl.load(order_ptr + rows), n_idx, n_idx < N, grow


@triton.jit
def _gate_up_f8_kernel(x8_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr,
                       tw_ptr, h8_ptr, hs_ptr, limit, NBM, DIM: tl.constexpr, INTER: tl.constexpr,
                       TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr, RB: tl.constexpr):
    """h8, hs [P sorted, INTER] (E4M3, E8M0 per 32) = quantized bf16(w * SwiGLU(bf16(W1 x), bf16(W3 x)))
    for a block of BM pairs of one expert and BN rows of I. Swap-AB as in kernels/moe.py: the weight
    group is the register A operand (M = rows), the tokens' group the shared B operand."""
    e, rows, rmask, pair, n_idx, n_mask, grow = _block(bexp_ptr, bbeg_ptr, bend_ptr, order_ptr, NBM, INTER, BM, BN,
                                                       GROUP_M)
    if e < 0:
        return
    tok = (pair // TOPK).to(tl.int64)
    acc1 = tl.zeros([BN, BM], tl.float32)
    acc3 = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, DIM, BK):
        for g in tl.static_range(0, BK // 32, 2):  # two groups' four MMAs in flight before their sums
            ka = k0 + 32 * g
            xa, sxa = act_group(x8_ptr, xs_ptr, tok, ka, DIM, DT, ASM)
            a1, s1a = weight_group(w1_ptr, s1_ptr, grow, ka, DIM, DT, ASM)
            a3, s3a = weight_group(w3_ptr, s3_ptr, grow, ka, DIM, DT, ASM)
            if g + 1 < BK // 32:
                xb, sxb = act_group(x8_ptr, xs_ptr, tok, ka + 32, DIM, DT, ASM)
                b1, s1b = weight_group(w1_ptr, s1_ptr, grow, ka + 32, DIM, DT, ASM)
                b3, s3b = weight_group(w3_ptr, s3_ptr, grow, ka + 32, DIM, DT, ASM)
                pa1 = tl.dot(a1, tl.trans(xa))
                pa3 = tl.dot(a3, tl.trans(xa))
                pb1 = tl.dot(b1, tl.trans(xb))
                pb3 = tl.dot(b3, tl.trans(xb))
                acc1 += pa1 * (s1a[:, None] * sxa[None, :])
                acc3 += pa3 * (s3a[:, None] * sxa[None, :])
                acc1 += pb1 * (s1b[:, None] * sxb[None, :])
                acc3 += pb3 * (s3b[:, None] * sxb[None, :])
            else:  # a last single group (K blocks of 32)
                pa1 = tl.dot(a1, tl.trans(xa))
                pa3 = tl.dot(a3, tl.trans(xa))
                acc1 += pa1 * (s1a[:, None] * sxa[None, :])
                acc3 += pa3 * (s3a[:, None] * sxa[None, :])
    tw = tl.load(tw_ptr + pair, mask=rmask, other=0.0)
    q, scale = swiglu_e4m3(acc1, acc3, tw, limit, BN, BM, RB)
    r64 = rows.to(tl.int64)
    q = q.to(tl.uint8).to(h8_ptr.dtype.element_ty, bitcast=True)
    tl.store(h8_ptr + r64[None, :] * INTER + halves_position(n_idx)[:, None], q, mask=rmask[None, :] & n_mask[:, None])
    grp = tl.min(n_idx, axis=0) // 32 + tl.arange(0, BN // 32)  # this tile's groups along I
    sbyte = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    tl.store(hs_ptr + r64[None, :] * (INTER // 32) + grp[:, None], sbyte.to(tl.uint8),
             mask=rmask[None, :] & (grp < INTER // 32)[:, None])


@triton.jit
def _down_f8_kernel(h8_ptr, hs_ptr, w2_ptr, s2_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, out_ptr, NBM,
                    DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, DT: tl.constexpr,
                    ASM: tl.constexpr, RB: tl.constexpr):
    """out[token] += bf16(W2 h) over a block of BM pairs of one expert and BN rows of dim (fp32 atomics; h
    carries the routing weight already)."""
    e, rows, rmask, pair, n_idx, n_mask, grow = _block(bexp_ptr, bbeg_ptr, bend_ptr, order_ptr, NBM, DIM, BM, BN,
                                                       GROUP_M)
    if e < 0:
        return
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, INTER, BK):
        for g in tl.static_range(0, BK // 32, 2):  # two groups' MMAs in flight before their sums
            ka = k0 + 32 * g
            ha, sha = act_group(h8_ptr, hs_ptr, r64, ka, INTER, DT, ASM)
            a, sa = weight_group(w2_ptr, s2_ptr, grow, ka, INTER, DT, ASM)
            if g + 1 < BK // 32:
                hb, shb = act_group(h8_ptr, hs_ptr, r64, ka + 32, INTER, DT, ASM)
                b, sb = weight_group(w2_ptr, s2_ptr, grow, ka + 32, INTER, DT, ASM)
                pa = tl.dot(a, tl.trans(ha))
                pb = tl.dot(b, tl.trans(hb))
                acc += pa * (sa[:, None] * sha[None, :])
                acc += pb * (sb[:, None] * shb[None, :])
            else:
                acc += tl.dot(a, tl.trans(ha)) * (sa[:, None] * sha[None, :])
    y = act(acc, RB)  # act(gemm(h, w2)), per expert
    tok = (pair // TOPK).to(tl.int64)
    tl.atomic_add(out_ptr + tok[None, :] * DIM + n_idx[:, None], y, mask=rmask[None, :] & n_mask[:, None],
                  sem="relaxed")  # out is read by a later launch only: no fence before each add


def grouped_f8(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, tw, aligned, limit: float, *, block_m: int,
               block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, interpreted: bool,
               launch_options: dict, bf16_acts: bool = True):
    """The two grouped FP8 GEMMs: x bf16 or float32 [T, dim] (quantized here to E4M3 per 32, as the reference's
    GEMM rounds it; exact where x is on that grid already), packed FP4 weights and E8M0 scales as in
    kernels/moe.py, tw float32 [T, k], aligned = moe_align(ids, E, block_m); bf16_acts: the `reference`
    numerics' bf16 roundings (else `fp32`'s). -> float32 [T, dim]."""
    from kernels.quant import quantize_fp8_triton
    order, bexp, bbeg, bend = aligned
    t, dim = x.shape
    e, inter, _ = w1.shape
    k = tw.shape[1]
    if block_k % 32 or dim % block_k or inter % block_k or block_n % 32:
        raise ValueError(f"the FP8 grouped GEMM needs K blocks of whole 32-groups dividing dim {dim} and I "
                         f"{inter}, and row blocks of whole groups (block_k {block_k}, block_n {block_n})")
    u8 = torch.uint8
    x8, xs = quantize_fp8_triton(x, 32)
    x8, xs = halves_order(x8), xs.view(u8)
    if interpreted:  # the interpreter reads bytes (act_group)
        x8 = x8.view(u8)
    w1b, w3b, w2b = (w.contiguous().view(u8) for w in (w1, w3, w2))
    s1, s3, s2 = (s.contiguous().view(u8) for s in (w1_scale, w3_scale, w2_scale))
    p = t * k
    h8 = torch.empty(p, inter, dtype=u8 if interpreted else torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(p, inter // 32, dtype=u8, device=x.device)
    out = torch.zeros(t, dim, dtype=torch.float32, device=x.device)
    nbm = bexp.numel()
    dt = tl.float32 if interpreted else tl.float8e4nv
    common = dict(TOPK=k, BM=block_m, BN=block_n, BK=block_k, GROUP_M=group_m, DT=dt, ASM=not interpreted,
                  RB=bool(bf16_acts), num_warps=num_warps, num_stages=num_stages, **launch_options)
    _gate_up_f8_kernel[(nbm * triton.cdiv(inter, block_n),)](
        x8, xs, w1b, s1, w3b, s3, order, bexp, bbeg, bend, tw.float().contiguous(), h8, hs, float(limit), nbm,
        DIM=dim, INTER=inter, **common)
    _down_f8_kernel[(nbm * triton.cdiv(dim, block_n),)](
        h8, hs, w2b, s2, order, bexp, bbeg, bend, out, nbm, DIM=dim, INTER=inter, **common)
    return out


def moe_f8_reference(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights,
                     swiglu_limit: float = 10.0, bf16_acts: bool = True):
    """engine/model/moe.py's routed experts in float64 (float32 off the CPU) on dequantized weights: x and
    w * h quantized to E4M3 per 32 (engine.quant); bf16_acts (`reference` numerics): gate, up, w * h and
    each expert's output rounded to bf16."""
    cdt = torch.float64 if x.device.type == "cpu" else torch.float32
    bf16 = (lambda v: v.float().to(torch.bfloat16).to(cdt)) if bf16_acts else (lambda v: v)
    fp8 = lambda v: Q.fp8_roundtrip(v.float(), 32).to(cdt)
    xq = fp8(x)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=cdt, device=x.device)
    for ex in torch.unique(topk_ids).tolist():
        if ex < 0:  # another rank's expert
            continue
        tok, slot = (topk_ids == ex).nonzero(as_tuple=True)
        a, b, c = (Q.dequantize_fp4(w[ex], s[ex], 32).to(cdt)
                   for w, s in ((w1, w1_scale), (w3, w3_scale), (w2, w2_scale)))
        gate, up = bf16(xq[tok] @ a.T).clamp(max=swiglu_limit), bf16(xq[tok] @ b.T).clamp(-swiglu_limit, swiglu_limit)
        h = fp8(bf16(gate * torch.sigmoid(gate) * up * topk_weights[tok, slot].to(cdt)[:, None]))
        out.index_add_(0, tok, bf16(h @ c.T))
    return out.float()
