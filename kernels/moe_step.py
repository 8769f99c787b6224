"""FP4 routed experts at decode-step widths (`moe_fp4_triton(step="gemv")`): a per-expert GEMV on CUDA cores.

At a release decode step (64 tokens x top-6 = 384 pairs over ~240 of 384 experts, ~1.6 tokens each) the
grouped tensor-core GEMM of kernels/moe.py pads every expert to 16 tokens and is issue-bound on its FP4
decode and the decoded tile's shared-memory round trip (ncu, run 13). Here each weight value is decoded
ONCE per expert and applied to that expert's tokens only:

- pairs are grouped by expert on the device (`moe.moe_align` with blocks of TB pairs; no host sync): a
  program is (block of <= TB pairs of one expert, block of BN weight rows, K slice of NIT x BKW words);
  an expert with more than TB pairs takes several blocks (its weights are decoded once per block).
- the block's pair count n (1..TB) picks one of TB copies of the K loop (`_tokens`, a uniform branch per
  program), so absent tokens cost nothing in the loop: per weight value, one decode (two nibbles per
  shift-and-mask pair into fp16 bits, fp16 -> fp32 convert: `fp4_tiles.nibble_pair`) and one FFMA per
  token; the E8M0 scale is one FFMA per 32-value group and token.
- thread tile: [rows, K groups, 4 words] (a 16-byte word load = one whole 32-group of one row), the
  vectors (x, h) stored split ([8, K/8]: entry 8 kw + j at j * K/8 + kw) so that each nibble position's
  4 vector entries are one 16-byte load, shared by every row the thread holds.
- K split with fp32 atomics into zeroed buffers and a last-arriver counter per (block, row block), as the
  GEMV of kernels/moe.py: gate/up -> the last split applies the SwiGLU (and, `hidden`, the engine's E4M3
  hidden state per 32 rows) and writes h; down -> tw * W2 h into out (hidden: the last split rounds the
  whole sum, act, then adds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import moe_f8
from kernels.fp4_tiles import nibble_pair, scale_words
from kernels.moe import _arrived_last, _gemv_swiglu_store, moe_align


# nibbles A and A + 4 of a 32-bit word as float32 E2M1 value * 2^-14 (exact), fp4_tiles.nibble_pair's bit
# assembly in PTX: the compiled nibble_pair repacked the fp16 halves across words with PRMT (0.37 a value)
# before converting them; here each pair is 4 32-bit operations (3 for A = 3) and two HADD2.F32
_PAIR_PTX = [tl.constexpr("""
{
.reg .b32 a, b;
.reg .b16 l, h;
%s
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mov.b32 {l, h}, a;
cvt.f32.f16 $0, l;
cvt.f32.f16 $1, h;
}
""" % body) for body in (
    "shl.b32 a, $2, 9;\nand.b32 a, a, 0x0E000E00;\nshl.b32 b, $2, 12;",
    "shl.b32 a, $2, 5;\nand.b32 a, a, 0x0E000E00;\nshl.b32 b, $2, 8;",
    "shl.b32 a, $2, 1;\nand.b32 a, a, 0x0E000E00;\nshl.b32 b, $2, 4;",
    "shr.b32 a, $2, 3;\nand.b32 a, a, 0x0E000E00;\nmov.b32 b, $2;")]
_PAIR0, _PAIR1, _PAIR2, _PAIR3 = _PAIR_PTX


@triton.jit
def _pair(wq, A: tl.constexpr, ASM: tl.constexpr):
    """(nibble A, nibble A + 4) of each word as float32 E2M1 value * 2^-14: PTX on the GPU, else
    fp4_tiles.nibble_pair (the interpreter)."""
    if ASM and A == 0:
        lo, hi = tl.inline_asm_elementwise(_PAIR0, "=r,=r,r", [wq], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif ASM and A == 1:
        lo, hi = tl.inline_asm_elementwise(_PAIR1, "=r,=r,r", [wq], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif ASM and A == 2:
        lo, hi = tl.inline_asm_elementwise(_PAIR2, "=r,=r,r", [wq], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    elif ASM:
        lo, hi = tl.inline_asm_elementwise(_PAIR3, "=r,=r,r", [wq], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo, hi = nibble_pair(wq, A)
    return lo, hi


@triton.jit
def _split4(t):
    """[..., 4] -> its four [...] slices (in-thread: the last dim is one 16-byte vector)."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + (2, 2)))  # a: entries 0, 2; b: 1, 3
    q0, q2 = tl.split(a)
    q1, q3 = tl.split(b)
    return q0, q1, q2, q3


@triton.jit
def _vec(v_ptr, off, A: tl.constexpr, KW: tl.constexpr):
    """Vector entries 8 kw + A and 8 kw + A + 4 for the words kw = off [KT, 4] (split layout), float32,
    as [KT] x 4 each (one 16-byte load per nibble position and K group)."""
    l0, l1, l2, l3 = _split4(tl.load(v_ptr + A * KW + off).to(tl.float32))
    h0, h1, h2, h3 = _split4(tl.load(v_ptr + (A + 4) * KW + off).to(tl.float32))
    return l0, l1, l2, l3, h0, h1, h2, h3


@triton.jit
def _fma(p, lo, hi, xl, xh):
    p += lo * xl[None, :]
    p += hi * xh[None, :]
    return p


@triton.jit
def _word(p0, p1, p2, p3, wq, A: tl.constexpr, x0, x1, x2, x3, NT: tl.constexpr, ASM: tl.constexpr):
    """p_j + nibbles A and A + 4 of the words wq [BN, KT] (decoded once) times token j's entries x_j =
    (low, high) [KT]."""
    lo, hi = _pair(wq, A, ASM)
    p0 = _fma(p0, lo, hi, x0[0], x0[1])
    if NT > 1:
        p1 = _fma(p1, lo, hi, x1[0], x1[1])
    if NT > 2:
        p2 = _fma(p2, lo, hi, x2[0], x2[1])
    if NT > 3:
        p3 = _fma(p3, lo, hi, x3[0], x3[1])
    return p0, p1, p2, p3


@triton.jit
def _step(wd, wdb, v0, v1, v2, v3, off, z, KW: tl.constexpr, NT: tl.constexpr, TWO: tl.constexpr,
          ASM: tl.constexpr):
    """One K step for NT tokens: the products of the step's words wd (and wdb: TWO) [BN, KT, 4] with the
    vectors v_j, summed over each K group -> p_j, q_j [BN, KT] (W v_j, Wb v_j); each word's nibbles decoded
    once, each vector load shared by both weights and every row the thread holds."""
    w0, w1, w2, w3 = _split4(wd)
    u0, u1, u2, u3 = _split4(wdb)
    p0, p1, p2, p3, q0, q1, q2, q3 = z, z, z, z, z, z, z, z
    for A in tl.static_range(4):
        y0 = _vec(v0, off, A, KW)
        y1, y2, y3 = y0, y0, y0
        if NT > 1:
            y1 = _vec(v1, off, A, KW)
        if NT > 2:
            y2 = _vec(v2, off, A, KW)
        if NT > 3:
            y3 = _vec(v3, off, A, KW)
        # word q's entries: (low q, high q) of each token's _vec
        p0, p1, p2, p3 = _word(p0, p1, p2, p3, w0, A, (y0[0], y0[4]), (y1[0], y1[4]), (y2[0], y2[4]),
                               (y3[0], y3[4]), NT, ASM)
        p0, p1, p2, p3 = _word(p0, p1, p2, p3, w1, A, (y0[1], y0[5]), (y1[1], y1[5]), (y2[1], y2[5]),
                               (y3[1], y3[5]), NT, ASM)
        p0, p1, p2, p3 = _word(p0, p1, p2, p3, w2, A, (y0[2], y0[6]), (y1[2], y1[6]), (y2[2], y2[6]),
                               (y3[2], y3[6]), NT, ASM)
        p0, p1, p2, p3 = _word(p0, p1, p2, p3, w3, A, (y0[3], y0[7]), (y1[3], y1[7]), (y2[3], y2[7]),
                               (y3[3], y3[7]), NT, ASM)
        if TWO:
            q0, q1, q2, q3 = _word(q0, q1, q2, q3, u0, A, (y0[0], y0[4]), (y1[0], y1[4]), (y2[0], y2[4]),
                                   (y3[0], y3[4]), NT, ASM)
            q0, q1, q2, q3 = _word(q0, q1, q2, q3, u1, A, (y0[1], y0[5]), (y1[1], y1[5]), (y2[1], y2[5]),
                                   (y3[1], y3[5]), NT, ASM)
            q0, q1, q2, q3 = _word(q0, q1, q2, q3, u2, A, (y0[2], y0[6]), (y1[2], y1[6]), (y2[2], y2[6]),
                                   (y3[2], y3[6]), NT, ASM)
            q0, q1, q2, q3 = _word(q0, q1, q2, q3, u3, A, (y0[3], y0[7]), (y1[3], y1[7]), (y2[3], y2[7]),
                                   (y3[3], y3[7]), NT, ASM)
    return p0, p1, p2, p3, q0, q1, q2, q3


@triton.jit
def _scale(s_ptr, soff, mask):
    """E8M0 bytes at soff [BN, KT] as float32 2^(byte - 127) * 2^14 (nibble_pair's values are 2^-14 x). Loaded
    a byte per thread element (contiguity hint 1): a coalesced byte layout would convert the partial sums
    it multiplies through shared memory (two barriers a K step, sm_90 SASS)."""
    byte = tl.load(s_ptr + soff, mask=mask, other=127).to(tl.int32)
    return ((byte + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM: tl.constexpr,
            BKW: tl.constexpr, NIT: tl.constexpr, NT: tl.constexpr, TWO: tl.constexpr, ASM: tl.constexpr):
    """Sums over words kw_first .. kw_first + NIT * BKW of W[rows] v_j for the NT vectors v0.. (split
    layout, [8, KDIM/8]); TWO: the same for a second weight Wb (gate and up). -> 8 float32 [BN]: W v_j for
    j = 0..3, then Wb v_j (unused ones zero). The NIT steps are unrolled: all their loads can be issued
    before the first decode."""
    KW: tl.constexpr = KDIM // 8
    KT: tl.constexpr = BKW // 4
    r64 = rows.to(tl.int64)
    kq = tl.arange(0, KT)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [KT, 4]: word within the step
    woff = r64[:, None, None] * KW + kw_first + kq[None, :, :]
    # scale byte of word r KW + kw: (r KW + kw) / 4 (KW = 4 KDIM/32), one per group: in the words' layout
    soff, _, _, _ = _split4(woff // 4)
    m3 = rmask[:, None, None]
    m2, _, _, _ = _split4(m3 & (kq >= 0)[None, :, :])
    z = tl.zeros([rows.shape[0], KT], tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = z, z, z, z, z, z, z, z
    for it in tl.static_range(NIT):
        wd = tl.load(w_ptr + woff + it * BKW, mask=m3, other=0)
        sc = _scale(s_ptr, soff + it * (BKW // 4), m2)
        if TWO:
            wdb = tl.load(wb_ptr + woff + it * BKW, mask=m3, other=0)
            scb = _scale(sb_ptr, soff + it * (BKW // 4), m2)
        else:
            wdb, scb = wd, sc
        p0, p1, p2, p3, q0, q1, q2, q3 = _step(wd, wdb, v0, v1, v2, v3, kw_first + it * BKW + kq, z, KW, NT, TWO,
                                               ASM)
        a0 += p0 * sc
        if TWO:
            b0 += q0 * scb
        if NT > 1:
            a1 += p1 * sc
            if TWO:
                b1 += q1 * scb
        if NT > 2:
            a2 += p2 * sc
            if TWO:
                b2 += q2 * scb
        if NT > 3:
            a3 += p3 * sc
            if TWO:
                b3 += q3 * scb
    return (tl.sum(a0, 1), tl.sum(a1, 1), tl.sum(a2, 1), tl.sum(a3, 1), tl.sum(b0, 1), tl.sum(b1, 1),
            tl.sum(b2, 1), tl.sum(b3, 1))


@triton.jit
def _block(order_ptr, bbeg_ptr, bend_ptr, TB: tl.constexpr):
    """A used block's pair count n (1..TB) and pairs p0..p3 (past n: the last pair again, computed and
    never stored)."""
    b = tl.program_id(0)
    r0 = tl.load(bbeg_ptr + b)
    n = tl.load(bend_ptr + b) - r0
    p0 = tl.load(order_ptr + r0)
    p1, p2, p3 = p0, p0, p0
    if TB > 1:
        p1 = tl.load(order_ptr + r0 + tl.minimum(n - 1, 1))
    if TB > 2:
        p2 = tl.load(order_ptr + r0 + tl.minimum(n - 1, 2))
    if TB > 3:
        p3 = tl.load(order_ptr + r0 + tl.minimum(n - 1, 3))
    return n, p0, p1, p2, p3


@triton.jit
def _by_count(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, n, KDIM: tl.constexpr,
              BKW: tl.constexpr, NIT: tl.constexpr, TB: tl.constexpr, TWO: tl.constexpr, ASM: tl.constexpr):
    """`_tokens` with as many tokens as the block has (a uniform branch per program)."""
    if TB == 1:
        r0, r1, r2, r3, r4, r5, r6, r7 = _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM, BKW, NIT, 1, TWO, ASM)
    elif n == 1:
        r0, r1, r2, r3, r4, r5, r6, r7 = _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM, BKW, NIT, 1, TWO, ASM)
    elif TB == 2:
        r0, r1, r2, r3, r4, r5, r6, r7 = _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM, BKW, NIT, 2, TWO, ASM)
    elif n == 2:
        r0, r1, r2, r3, r4, r5, r6, r7 = _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM, BKW, NIT, 2, TWO, ASM)
    elif TB == 3:
        r0, r1, r2, r3, r4, r5, r6, r7 = _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM, BKW, NIT, 3, TWO, ASM)
    elif n == 3:
        r0, r1, r2, r3, r4, r5, r6, r7 = _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM, BKW, NIT, 3, TWO, ASM)
    else:
        r0, r1, r2, r3, r4, r5, r6, r7 = _tokens(w_ptr, s_ptr, wb_ptr, sb_ptr, v0, v1, v2, v3, rows, rmask, kw_first, KDIM, BKW, NIT, 4, TWO, ASM)
    return r0, r1, r2, r3, r4, r5, r6, r7


@triton.jit
def _gate_up_slot(gu_ptr, h_ptr, tw_ptr, p, g, u, rows, rmask, live, NP, limit, INTER: tl.constexpr,
                  BN: tl.constexpr, KS: tl.constexpr, FH: tl.constexpr, RB: tl.constexpr):
    if KS > 1:
        gp = gu_ptr + p.to(tl.int64) * INTER + rows
        tl.atomic_add(gp, g, mask=rmask & live)
        tl.atomic_add(gp + NP * INTER, u, mask=rmask & live)
    elif live:
        _gemv_swiglu_store(h_ptr, tw_ptr, p, rows, rmask, g, u, limit, INTER, BN, FH, RB)


@triton.jit
def _gate_up_last(gu_ptr, h_ptr, tw_ptr, p, rows, rmask, live, NP, limit, INTER: tl.constexpr, BN: tl.constexpr,
                  FH: tl.constexpr, RB: tl.constexpr):
    if live:
        gp = gu_ptr + p.to(tl.int64) * INTER + rows
        g = tl.load(gp, mask=rmask, other=0.0, cache_modifier=".cg")
        u = tl.load(gp + NP * INTER, mask=rmask, other=0.0, cache_modifier=".cg")
        _gemv_swiglu_store(h_ptr, tw_ptr, p, rows, rmask, g, u, limit, INTER, BN, FH, RB)


@triton.jit
def _step_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, gu_ptr,
                         cnt_ptr, h_ptr, tw_ptr, NP, limit, DIM: tl.constexpr, INTER: tl.constexpr,
                         TOPK: tl.constexpr, TB: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                         NIT: tl.constexpr, KS: tl.constexpr, FH: tl.constexpr, RB: tl.constexpr,
                         ASM: tl.constexpr):
    """Program (block of <= TB pairs of one expert, BN rows of I, K split of KS): W1 x and W3 x of each pair
    over its K slice into gu [2, P, I] (fp32, zeroed; x split [T, 8, DIM/8] float32); the last split of a
    (block, row block) to arrive (counter cnt [blocks, row blocks], zeroed) writes h [P, 8, I/8] as
    kernels/moe.py's GEMV does (FH: the engine's hidden state, BN whole 32-row groups)."""
    e = tl.load(bexp_ptr + tl.program_id(0))
    if e < 0:
        return
    n, p0, p1, p2, p3 = _block(order_ptr, bbeg_ptr, bend_ptr, TB)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < INTER
    grow = e.to(tl.int64) * INTER + rows
    kw_first = tl.program_id(2) * (NIT * BKW)
    g0, g1, g2, g3, u0, u1, u2, u3 = _by_count(
        w1_ptr, s1_ptr, w3_ptr, s3_ptr, x_ptr + (p0 // TOPK).to(tl.int64) * DIM, x_ptr + (p1 // TOPK).to(tl.int64) * DIM,
        x_ptr + (p2 // TOPK).to(tl.int64) * DIM, x_ptr + (p3 // TOPK).to(tl.int64) * DIM, grow, rmask, kw_first, n,
        DIM, BKW, NIT, TB, True, ASM)
    _gate_up_slot(gu_ptr, h_ptr, tw_ptr, p0, g0, u0, rows, rmask, n > 0, NP, limit, INTER, BN, KS, FH, RB)
    if TB > 1:
        _gate_up_slot(gu_ptr, h_ptr, tw_ptr, p1, g1, u1, rows, rmask, n > 1, NP, limit, INTER, BN, KS, FH, RB)
    if TB > 2:
        _gate_up_slot(gu_ptr, h_ptr, tw_ptr, p2, g2, u2, rows, rmask, n > 2, NP, limit, INTER, BN, KS, FH, RB)
    if TB > 3:
        _gate_up_slot(gu_ptr, h_ptr, tw_ptr, p3, g3, u3, rows, rmask, n > 3, NP, limit, INTER, BN, KS, FH, RB)
    if KS > 1:
        if _arrived_last(cnt_ptr, KS):
            _gate_up_last(gu_ptr, h_ptr, tw_ptr, p0, rows, rmask, n > 0, NP, limit, INTER, BN, FH, RB)
            if TB > 1:
                _gate_up_last(gu_ptr, h_ptr, tw_ptr, p1, rows, rmask, n > 1, NP, limit, INTER, BN, FH, RB)
            if TB > 2:
                _gate_up_last(gu_ptr, h_ptr, tw_ptr, p2, rows, rmask, n > 2, NP, limit, INTER, BN, FH, RB)
            if TB > 3:
                _gate_up_last(gu_ptr, h_ptr, tw_ptr, p3, rows, rmask, n > 3, NP, limit, INTER, BN, FH, RB)


@triton.jit
def _down_slot(out_ptr, ys_ptr, tw_ptr, p, y, rows, rmask, live, DIM: tl.constexpr, TOPK: tl.constexpr,
               KS: tl.constexpr, FH: tl.constexpr, RB: tl.constexpr):
    dst = out_ptr + (p // TOPK).to(tl.int64) * DIM + rows
    if not FH:
        tl.atomic_add(dst, y * tl.load(tw_ptr + p), mask=rmask & live)
    elif KS > 1:
        tl.atomic_add(ys_ptr + p.to(tl.int64) * DIM + rows, y, mask=rmask & live)
    else:
        tl.atomic_add(dst, moe_f8.act(y, RB), mask=rmask & live)


@triton.jit
def _down_last(out_ptr, ys_ptr, p, rows, rmask, live, DIM: tl.constexpr, TOPK: tl.constexpr, RB: tl.constexpr):
    if live:
        y = tl.load(ys_ptr + p.to(tl.int64) * DIM + rows, mask=rmask, other=0.0, cache_modifier=".cg")
        tl.atomic_add(out_ptr + (p // TOPK).to(tl.int64) * DIM + rows, moe_f8.act(y, RB), mask=rmask)


@triton.jit
def _step_down_kernel(h_ptr, w2_ptr, s2_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, tw_ptr, out_ptr, ys_ptr,
                      cnt_ptr, DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, TB: tl.constexpr,
                      BN: tl.constexpr, BKW: tl.constexpr, NIT: tl.constexpr, KS: tl.constexpr,
                      FH: tl.constexpr, RB: tl.constexpr, ASM: tl.constexpr):
    """Program (block of <= TB pairs of one expert, BN rows of dim, K split of KS): tw * W2 h over its K
    slice added into out (fp32 atomics); FH: act(W2 h) of the whole sum (w is in h already): the splits
    add into ys [P, dim] (zeroed) and the last to arrive (counter cnt, zeroed) rounds it into out."""
    e = tl.load(bexp_ptr + tl.program_id(0))
    if e < 0:
        return
    n, p0, p1, p2, p3 = _block(order_ptr, bbeg_ptr, bend_ptr, TB)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < DIM
    kw_first = tl.program_id(2) * (NIT * BKW)
    y0, y1, y2, y3, _, _, _, _ = _by_count(
        w2_ptr, s2_ptr, w2_ptr, s2_ptr, h_ptr + p0.to(tl.int64) * INTER, h_ptr + p1.to(tl.int64) * INTER,
        h_ptr + p2.to(tl.int64) * INTER, h_ptr + p3.to(tl.int64) * INTER, e.to(tl.int64) * DIM + rows, rmask,
        kw_first, n, INTER, BKW, NIT, TB, False, ASM)
    _down_slot(out_ptr, ys_ptr, tw_ptr, p0, y0, rows, rmask, n > 0, DIM, TOPK, KS, FH, RB)
    if TB > 1:
        _down_slot(out_ptr, ys_ptr, tw_ptr, p1, y1, rows, rmask, n > 1, DIM, TOPK, KS, FH, RB)
    if TB > 2:
        _down_slot(out_ptr, ys_ptr, tw_ptr, p2, y2, rows, rmask, n > 2, DIM, TOPK, KS, FH, RB)
    if TB > 3:
        _down_slot(out_ptr, ys_ptr, tw_ptr, p3, y3, rows, rmask, n > 3, DIM, TOPK, KS, FH, RB)
    if FH and KS > 1:
        if _arrived_last(cnt_ptr, KS):
            _down_last(out_ptr, ys_ptr, p0, rows, rmask, n > 0, DIM, TOPK, RB)
            if TB > 1:
                _down_last(out_ptr, ys_ptr, p1, rows, rmask, n > 1, DIM, TOPK, RB)
            if TB > 2:
                _down_last(out_ptr, ys_ptr, p2, rows, rmask, n > 2, DIM, TOPK, RB)
            if TB > 3:
                _down_last(out_ptr, ys_ptr, p3, rows, rmask, n > 3, DIM, TOPK, RB)


def _k_split(kw: int, block_kw: int, iters: int) -> tuple[int, int, int]:
    """Words per step (the largest power of two <= block_kw dividing kw, at least one 32-group's 4),
    unrolled steps per program (the largest divisor of the step count <= iters), K splits."""
    bkw = 4
    while bkw * 2 <= max(block_kw, 4) and kw % (bkw * 2) == 0:
        bkw *= 2
    steps = kw // bkw
    nit = max(d for d in range(1, max(1, iters) + 1) if steps % d == 0)
    return bkw, nit, steps // nit


def split_layout(v: torch.Tensor) -> torch.Tensor:
    """[R, K] -> float32 [R, 8, K/8]: entry 8 kw + j at j * K/8 + kw (one copy)."""
    r, k = v.shape
    return v.view(r, k // 8, 8).transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)


def moe_step_gemv(x, w1w, s1, w3w, s3, w2w, s2, topk_ids, tw, limit: float, *, fp8_hidden: bool, rb: bool,
                  tokens: int = 2, block_n: int = 32, block_kw: int = 64, iters: int = 1, down_block_n: int = 32,
                  down_block_kw: int = 32, down_iters: int = 3, num_warps: int = 4,
                  down_num_warps: int | None = None) -> torch.Tensor:
    """The per-expert GEMV (module docstring) on kernels/moe.py's prepared operands: x bf16 [T, dim] (on the
    E4M3 grid for fp8_hidden), weights as int32 words [E, N, K/8], scale bytes uint8 [E, N, K/32], tw float32
    [T, k]; fp8_hidden: the engine's hidden state (rb: `reference`'s bf16 roundings). -> float32 [T, dim].
    tokens: pairs per block (1..4; the registers are the largest count's: sm_90, triton 3.7, gate/up 96 at 2,
    255 + 60 B spilled at 4, so 2 by default: an expert with 3-4 pairs takes two blocks); block_n / block_kw / iters: gate/up rows, words per K step, unrolled
    steps per program (down_*: the down kernel's)."""
    t, dim = x.shape
    e, inter = w1w.shape[0], w1w.shape[1]
    k = topk_ids.shape[1]
    p = t * k
    if not 1 <= tokens <= 4:
        raise ValueError(f"tokens per block must be 1..4, not {tokens}")
    if fp8_hidden:  # whole 32-row groups per gate/up block (the E4M3 quantization of w * h)
        block_n = -(-block_n // 32) * 32
    order, bexp, bbeg, bend = moe_align(topk_ids, e, tokens)
    nb = bexp.numel()
    (bkw1, it1, ks1), (bkw2, it2, ks2) = _k_split(dim // 8, block_kw, iters), _k_split(inter // 8, down_block_kw,
                                                                                       down_iters)
    nrb, nrb2 = triton.cdiv(inter, block_n), triton.cdiv(dim, down_block_n)
    ys_n = p * dim if fp8_hidden and ks2 > 1 else 0
    # one zeroed buffer (one memset): out [T, dim], gate and up sums [2, P, I], counters [NB, nrb], and for the
    # hidden state's down sums [P, dim] and their counters [NB, nrb2]
    sizes = (t * dim, 2 * p * inter if ks1 > 1 else 0, nb * nrb, ys_n, nb * nrb2 if ys_n else 0)
    out, gu, cnt, ys, cnt2 = torch.zeros(sum(sizes), dtype=torch.float32, device=x.device).split(sizes)
    out, cnt, cnt2 = out.view(t, dim), cnt.view(torch.int32), cnt2.view(torch.int32)
    h = torch.empty(p, inter, dtype=torch.float32, device=x.device)
    import os
    asm = os.environ.get("TRITON_INTERPRET", "0") != "1"  # the interpreter runs no PTX
    common = dict(TOPK=k, TB=tokens, FH=fp8_hidden, RB=rb, ASM=asm)
    _step_gate_up_kernel[(nb, nrb, ks1)](
        split_layout(x), w1w, s1, w3w, s3, order, bexp, bbeg, bend, gu, cnt, h, tw, p, float(limit), DIM=dim,
        INTER=inter, BN=block_n, BKW=bkw1, NIT=it1, KS=ks1, num_warps=num_warps, **common)
    _step_down_kernel[(nb, nrb2, ks2)](
        h, w2w, s2, order, bexp, bbeg, bend, tw, out, ys, cnt2, DIM=dim, INTER=inter, BN=down_block_n, BKW=bkw2,
        NIT=it2, KS=ks2, num_warps=down_num_warps or num_warps, **common)
    return out
