"""The routed experts' decode path (kernels/moe.py picks it for a few (token, expert) pairs): GEMV on CUDA cores.

One program per (pair, block of weight rows, K slice): split-K so that thousands of short programs each issue
all their 16-byte word loads at once (a K slice of `iters` unrolled steps) and the H200's 132 SMs keep enough
bytes in flight. The gate/up kernel adds its partial W1 x, W3 x into a zeroed fp32 buffer (atomics); the last
K split of each row block to finish (an atomic counter) applies the clamped SwiGLU and writes h; the down kernel
adds tw * W2 h into out (atomics). Weights as int32 words of 8 FP4 nibbles, E8M0 scale bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import moe_f8
from kernels.fp4_tiles import nibble_pair, scale_words


@triton.jit
def _gemv_vec(v_ptr, kw, j: tl.constexpr, KW: tl.constexpr, SPLIT_LAYOUT: tl.constexpr):
    """Vector entries 8 * kw + j as float32 [BKW]: stored [8, KW] (entry 8 kw + j at j * KW + kw,
    contiguous along kw: h from the gate/up kernel) if SPLIT_LAYOUT, else in natural order (x)."""
    if SPLIT_LAYOUT:
        return tl.load(v_ptr + j * KW + kw).to(tl.float32)
    else:
        return tl.load(v_ptr + kw * 8 + j).to(tl.float32)


@triton.jit
def _gemv_step(wd, sc, wdb, scb, v_ptr, kw, acc, accb, KW: tl.constexpr, SPLIT_LAYOUT: tl.constexpr,
               TWO: tl.constexpr):
    """One K step of `_gemv_rows` on loaded words: acc (+ accb) += decoded W[rows, kw] * v * scale."""
    part = tl.zeros(acc.shape, tl.float32)
    partb = tl.zeros(acc.shape, tl.float32)
    for A in tl.static_range(4):
        vlo = _gemv_vec(v_ptr, kw, A, KW, SPLIT_LAYOUT)[None, :]
        vhi = _gemv_vec(v_ptr, kw, A + 4, KW, SPLIT_LAYOUT)[None, :]
        lo, hi = nibble_pair(wd, A)  # two separate += so each product is one FFMA into the running part
        part += lo * vlo
        part += hi * vhi
        if TWO:
            lo, hi = nibble_pair(wdb, A)
            partb += lo * vlo
            partb += hi * vhi
    acc += part * sc
    if TWO:
        accb += partb * scb
    return acc, accb


@triton.jit
def _gemv_rows_prefetch(w_ptr, s_ptr, wb_ptr, sb_ptr, v_ptr, rows, rmask, kw_first, KDIM: tl.constexpr,
                        BKW: tl.constexpr, NIT: tl.constexpr, SPLIT_LAYOUT: tl.constexpr, TWO: tl.constexpr):
    """`_gemv_rows` as a rolled loop that issues step it+1's word and scale loads before decoding step
    it (a register double buffer: the loads of the next step are in flight during this step's decode,
    which the unrolled version leaves to the compiler's scheduling)."""
    KW: tl.constexpr = KDIM // 8
    r64 = rows.to(tl.int64)
    soff = r64 * (KDIM // 32)
    kw = kw_first + tl.arange(0, BKW)
    woff = r64[:, None] * KW + kw[None, :]
    wd = tl.load(w_ptr + woff, mask=rmask[:, None], other=0)
    sc = scale_words(s_ptr, soff, kw_first, BKW, rmask[:, None])
    wdb = wd
    scb = sc
    if TWO:
        wdb = tl.load(wb_ptr + woff, mask=rmask[:, None], other=0)
        scb = scale_words(sb_ptr, soff, kw_first, BKW, rmask[:, None])
    acc = tl.zeros([rows.shape[0], BKW], tl.float32)
    accb = tl.zeros([rows.shape[0], BKW], tl.float32)
    for it in range(NIT):
        nmask = rmask[:, None] & (it + 1 < NIT)
        kwn = kw + BKW
        wdn = tl.load(w_ptr + woff + BKW, mask=nmask, other=0)
        scn = scale_words(s_ptr, soff, kw_first + (it + 1) * BKW, BKW, nmask)
        wdbn = wdn
        scbn = scn
        if TWO:
            wdbn = tl.load(wb_ptr + woff + BKW, mask=nmask, other=0)
            scbn = scale_words(sb_ptr, soff, kw_first + (it + 1) * BKW, BKW, nmask)
        acc, accb = _gemv_step(wd, sc, wdb, scb, v_ptr, kw, acc, accb, KW, SPLIT_LAYOUT, TWO)
        wd, sc, wdb, scb, kw, woff = wdn, scn, wdbn, scbn, kwn, woff + BKW
    return _row_sums(acc, accb, TWO)


@triton.jit
def _gemv_rows(w_ptr, s_ptr, wb_ptr, sb_ptr, v_ptr, rows, rmask, kw_first, KDIM: tl.constexpr,
               BKW: tl.constexpr, NIT: tl.constexpr, SPLIT_LAYOUT: tl.constexpr, TWO: tl.constexpr):
    """sum over words kw_first .. kw_first + NIT * BKW of W[rows, 8 kw .. 8 kw + 7] * v (FP4 weight
    [N, KDIM] as int32 words) -> fp32 [BR]; TWO: the same for a second weight Wb sharing each loaded
    piece of v (gate and up), else the second result is the first. The NIT steps are unrolled, so every
    step's loads can be issued before the first decode."""
    KW: tl.constexpr = KDIM // 8
    r64 = rows.to(tl.int64)
    acc = tl.zeros([rows.shape[0], BKW], tl.float32)
    accb = tl.zeros([rows.shape[0], BKW], tl.float32)
    for it in tl.static_range(NIT):
        kw = kw_first + it * BKW + tl.arange(0, BKW)
        woff = r64[:, None] * KW + kw[None, :]
        wd = tl.load(w_ptr + woff, mask=rmask[:, None], other=0)
        sc = scale_words(s_ptr, r64 * (KDIM // 32), kw_first + it * BKW, BKW, rmask[:, None])
        if TWO:
            wdb = tl.load(wb_ptr + woff, mask=rmask[:, None], other=0)
            scb = scale_words(sb_ptr, r64 * (KDIM // 32), kw_first + it * BKW, BKW, rmask[:, None])
        else:
            wdb, scb = wd, sc
        acc, accb = _gemv_step(wd, sc, wdb, scb, v_ptr, kw, acc, accb, KW, SPLIT_LAYOUT, TWO)
    return _row_sums(acc, accb, TWO)


@triton.jit
def _row_sums(acc, accb, TWO: tl.constexpr):
    """The GEMV's per-lane partials [BR, BKW] summed per row: (W x, Wb x), or (W x, W x) without a second weight."""
    y = tl.sum(acc, axis=1)
    if TWO:
        return y, tl.sum(accb, axis=1)
    else:
        return y, y


@triton.jit
def _gemv_pair_rows(ids_ptr, BN: tl.constexpr, N: tl.constexpr):
    """This program's (token, expert) pair p, its expert e and its block of BN output rows of N."""
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    return p, e, rows, rows < N


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, ids_ptr, gu_ptr, cnt_ptr, h_ptr, tw_ptr, NP, limit,
                         DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                         BN: tl.constexpr, BKW: tl.constexpr, NIT: tl.constexpr, KS: tl.constexpr,
                         PF: tl.constexpr = False, FH: tl.constexpr = False, RB: tl.constexpr = False,
                         XS: tl.constexpr = False):
    """Program (pair, row block, K split of KS): partial W1 x and W3 x added into gu [2, P, I] (fp32,
    zeroed); the last split of a row block to arrive (counter cnt [P, row blocks], zeroed) applies the
    clamped SwiGLU and writes h [P, 8, I/8] (row r at (r % 8) * I/8 + r // 8: the down kernel's
    contiguous vector order); FH: the engine's hidden state (moe_f8.swiglu_e4m3, w included; BN whole
    32-row groups). XS: x [T, 8, DIM/8] in that order too (`split_vector`), else x [T, DIM]."""
    p, e, rows, rmask = _gemv_pair_rows(ids_ptr, BN, INTER)
    kw_first = tl.program_id(2) * (NIT * BKW)
    grow = e * INTER + rows
    xv = x_ptr + (p // TOPK).to(tl.int64) * DIM
    if PF:
        g, u = _gemv_rows_prefetch(w1_ptr, s1_ptr, w3_ptr, s3_ptr, xv, grow, rmask, kw_first, DIM, BKW, NIT,
                                   XS, True)
    else:
        g, u = _gemv_rows(w1_ptr, s1_ptr, w3_ptr, s3_ptr, xv, grow, rmask, kw_first, DIM, BKW, NIT, XS, True)
    if KS > 1:
        gp = gu_ptr + p.to(tl.int64) * INTER + rows
        tl.atomic_add(gp, g, mask=rmask, sem="relaxed")  # ordered before the counter by _arrived_last
        tl.atomic_add(gp + NP * INTER, u, mask=rmask, sem="relaxed")
        if _arrived_last(cnt_ptr, KS):
            g = tl.load(gp, mask=rmask, other=0.0, cache_modifier=".cg")
            u = tl.load(gp + NP * INTER, mask=rmask, other=0.0, cache_modifier=".cg")
            _gemv_swiglu_store(h_ptr, tw_ptr, p, rows, rmask, g, u, limit, INTER, BN, FH, RB)
    else:
        _gemv_swiglu_store(h_ptr, tw_ptr, p, rows, rmask, g, u, limit, INTER, BN, FH, RB)


@triton.jit
def _gemv_swiglu_store(h_ptr, tw_ptr, p, rows, rmask, g, u, limit, INTER: tl.constexpr, BN: tl.constexpr,
                       FH: tl.constexpr, RB: tl.constexpr):
    if FH:  # as the grouped kernels' epilogue, for one pair: [BN, 1]
        tw = tl.load(tw_ptr + p + tl.arange(0, 1))
        h = tl.reshape(moe_f8.swiglu_e4m3_values(g[:, None], u[:, None], tw, limit, BN, 1, RB), (BN,))
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + p.to(tl.int64) * INTER + (rows % 8) * (INTER // 8) + rows // 8, h, mask=rmask)


@triton.jit
def _gemv_down_kernel(h_ptr, w2_ptr, s2_ptr, ids_ptr, tw_ptr, out_ptr, ys_ptr, cnt_ptr,
                      DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                      BN: tl.constexpr, BKW: tl.constexpr, NIT: tl.constexpr, PF: tl.constexpr = False,
                      FH: tl.constexpr = False, RB: tl.constexpr = False, KS: tl.constexpr = 1):
    """Program (pair, row block, K split of KS): tw * W2 h over its K slice added into out (fp32 atomics);
    FH: act(W2 h) (w is in h already), which needs the whole sum: the K splits add into ys [P, dim] (zeroed)
    and the last to arrive (counter cnt [P, row blocks], zeroed) rounds it into out."""
    p, e, rows, rmask = _gemv_pair_rows(ids_ptr, BN, DIM)
    kw_first = tl.program_id(2) * (NIT * BKW)
    if PF:
        y, _ = _gemv_rows_prefetch(w2_ptr, s2_ptr, w2_ptr, s2_ptr, h_ptr + p.to(tl.int64) * INTER, e * DIM + rows,
                                   rmask, kw_first, INTER, BKW, NIT, True, False)
    else:
        y, _ = _gemv_rows(w2_ptr, s2_ptr, w2_ptr, s2_ptr, h_ptr + p.to(tl.int64) * INTER, e * DIM + rows, rmask,
                          kw_first, INTER, BKW, NIT, True, False)
    dst = out_ptr + (p // TOPK).to(tl.int64) * DIM + rows
    if not FH:  # relaxed where no counter follows (out is read by a later launch only)
        tl.atomic_add(dst, y * tl.load(tw_ptr + p), mask=rmask, sem="relaxed")
    elif KS > 1:
        yp = ys_ptr + p.to(tl.int64) * DIM + rows
        tl.atomic_add(yp, y, mask=rmask, sem="relaxed")  # ordered before the counter by _arrived_last
        if _arrived_last(cnt_ptr, KS):
            tl.atomic_add(dst, moe_f8.act(tl.load(yp, mask=rmask, other=0.0, cache_modifier=".cg"), RB), mask=rmask,
                          sem="relaxed")
    else:
        tl.atomic_add(dst, moe_f8.act(y, RB), mask=rmask, sem="relaxed")


@triton.jit
def _arrived_last(cnt_ptr, KS: tl.constexpr):
    """After this program's partial sums are issued: count its arrival at its (pair, row block) counter; True
    for the last of the KS K splits, which then reads the sums (from L2, after its acquire).
    The partial adds may be relaxed (no fence of their own, the default acq_rel put a MEMBAR.ALL.GPU before
    each): the barrier orders every thread's adds before the increment, and the increment's release is
    cumulative over them (PTX memory model; the pattern of CUTLASS's split-K semaphore)."""
    tl.debug_barrier()  # every thread's partials before the one increment (release)
    done = tl.atomic_add(cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 1, sem="acq_rel")
    return done == KS - 1


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _gemv_split(kw: int, block_kw: int, iters: int) -> tuple[int, int, int]:
    """Words per step (the largest power of two <= block_kw dividing kw, at least one scale group's 4),
    unrolled steps per program (the largest divisor of the step count <= iters) and the number of K
    splits: no masked K tail."""
    bkw = _pow2_divisor(kw, max(block_kw, 4))
    steps = kw // bkw
    nit = max(d for d in range(1, max(1, iters) + 1) if steps % d == 0)
    return bkw, nit, steps // nit


def pair_experts(topk_ids: torch.Tensor, tw: torch.Tensor):
    """Each (token, expert) pair's expert id (int32) and weight: a negative id (another rank's slot) as expert 0 at
    weight 0."""
    elsewhere = topk_ids < 0
    return topk_ids.clamp_min(0).to(torch.int32).contiguous(), tw.masked_fill(elsewhere, 0.0).contiguous()


def split_k_buffers(t: int, dim: int, p: int, inter: int, nrb: int, nrb2: int, device):
    """One zeroed buffer (one memset) for a split-K decode of p pairs of t tokens: out [T, dim], the gate and up
    sums [2, P, I], their counters [P, nrb] (int32), and where nrb2 > 0 (the hidden state's down in K splits) the
    down sums [P, dim] and their counters [P, nrb2]."""
    sizes = (t * dim, 2 * p * inter, p * nrb, p * dim if nrb2 else 0, p * nrb2)
    out, gu, cnt, ys, cnt2 = torch.zeros(sum(sizes), dtype=torch.float32, device=device).split(sizes)
    return out.view(t, dim), gu, cnt.view(torch.int32), ys, cnt2.view(torch.int32)


def split_vector(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> float32 [T, 8, K/8] (its values): entry 8 kw + j at j * K/8 + kw, the order and type the GEMV
    reads h in (a K step's [BKW] piece of each of the 8 planes contiguous: four float32 a thread, one 16-byte load
    straight into the layout its FMAs use, where bf16 pieces are loaded one value a thread and moved)."""
    t, kdim = x.shape
    out = torch.empty(t, 8, kdim // 8, dtype=torch.float32, device=x.device)
    return out.copy_(x.reshape(t, kdim // 8, 8).transpose(1, 2))  # one copy kernel, the cast in it


def moe_gemv(x, w1w, s1, w3w, s3, w2w, s2, topk_ids, tw, swiglu_limit: float, hidden: str | None, *,
             block_n: int, block_kw: int, iters: int, down_block_n: int, down_block_kw: int, down_iters: int,
             num_warps: int, down_num_warps: int | None, prefetch: bool, x_split: bool = False) -> torch.Tensor:
    """out float32 [T, dim] = the routed experts on T tokens (kernels/moe.py moe_fp4_triton's GEMV path, its
    gemv_* knobs): weights as int32 words, scales as bytes, tw float32 [T, k]; a negative id (another rank's
    slot) counts as expert 0 at weight 0; hidden: the engine's hidden-state numerics (moe._hidden) or None.
    x_split: x read from `split_vector`'s copy, as the down reads h. In x's natural order each of a K step's 8
    strided vector loads goes through shared memory into the FMAs' layout, two barriers apiece, and the next load
    is issued only past them: 8 dependent L2 round trips a program (sm_90 SASS, triton 3.6); in split order at
    32-word steps (block_kw 32) they are 16-byte ones straight into that layout, with no barrier, as the down's are
    (at 128-word steps Triton still moves each through shared memory)."""
    t, dim = x.shape
    p, k = topk_ids.numel(), topk_ids.shape[1]
    inter = w1w.shape[1]
    fp8_hidden, rb = hidden is not None, hidden == "reference"
    ids, tw = pair_experts(topk_ids, tw)
    if fp8_hidden:  # whole 32-row groups per gate/up block (the E4M3 quantization of w * h)
        block_n = -(-block_n // 32) * 32
    (bkw1, it1, ks1), (bkw2, it2, ks2) = (_gemv_split(dim // 8, block_kw, iters),
                                          _gemv_split(inter // 8, down_block_kw, down_iters))
    nrb, nrb2 = triton.cdiv(inter, block_n), triton.cdiv(dim, down_block_n)
    out, gu, cnt, ys, cnt2 = split_k_buffers(t, dim, p, inter, nrb, nrb2 if fp8_hidden and ks2 > 1 else 0, x.device)
    h = torch.empty(p, inter, dtype=torch.float32, device=x.device)
    _gemv_gate_up_kernel[(p, nrb, ks1)](
        split_vector(x) if x_split else x.contiguous(), w1w, s1, w3w, s3, ids, gu, cnt, h, tw, p,
        float(swiglu_limit), DIM=dim, INTER=inter, TOPK=k, BN=block_n, BKW=bkw1, NIT=it1, KS=ks1, PF=prefetch,
        FH=fp8_hidden, RB=rb, XS=x_split, num_warps=num_warps)
    _gemv_down_kernel[(p, nrb2, ks2)](
        h, w2w, s2, ids, tw, out, ys, cnt2, DIM=dim, INTER=inter, TOPK=k, BN=down_block_n, BKW=bkw2, NIT=it2,
        PF=prefetch, FH=fp8_hidden, RB=rb, KS=ks2, num_warps=down_num_warps or num_warps)
    return out
