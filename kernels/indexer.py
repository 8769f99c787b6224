"""Lightning indexer: FP4 queries x FP4 keys -> weighted ReLU head sum -> masked top-k positions.

Shapes (release: H = 32 heads, D = 128, groups of 32 with E8M0 scales, top-k 512):
  q_packed  int8 [T, H, D/2]      q_scale  float8_e8m0fnu [T, H, D/32]
  k_packed  int8 [N, D/2]         k_scale  float8_e8m0fnu [N, D/32]
  weights   float32 [T, H]        (already times D^-0.5 * H^-0.5)
  n_visible int32 [T]             entry j is visible to query t iff j < n_visible[t]
  pool_mask bool [T, ceil(N/pool_block)] or None: entry j allowed iff pool_mask[t, j // pool_block]
score[t, j] = sum_h w[t,h] * relu(q[t,h] . k[j]); masked entries are -inf.
`indexer_topk_*` returns int32 [T, k]: positions of the top min(k, allowed) scores, ascending, -1 padded.

The scoring kernel takes both operands as E4M3, each query row's group exponents folded into its
operand (exact while they span <= 14), and by default one K = 32 dot per group with the key's group
scale applied to the fp32 result. key_fold=True (a knob, off by default) folds the keys' group
exponents the same way: one K = D dot per tile and the key's common factor after the head sum, exact
with an exact float32 dot (the interpreter) while every key's groups span <= 14, and faster on the
H200 (prefill 4K x 64K: 5.13 ms, 3.82-3.98 with more programs per SM, against 7.87; decode 1M keys
with its top-512: 148 us, 132 at 4 warps, against 139). It is off because the H200's FP8 MMA keeps 13
mantissa bits when it adds a K = 32 block into a running accumulator: one FP4 group's dot (at most
32 * 36 in steps of 1/4) fits them, so the per-group form is exact, but a chain of differently scaled
groups does not: scores 1.3e-4 off a float64 reference (6e-8 per group), a 1M-key decode top-512
changed. benches/kernels.py's prefill sweep times it and rejects it on its check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels import indexer_rs
from kernels._formats import (E2M1_AS_E4M3_PTX, e2m1_as_e4m3, e4m3_code, e4m3_operand, e4m3_value, e8m0_value,
                             fp4_value, interpreted, register_cap, sm_count)
from kernels.topk import _pow2, default_groups, select_from_maxima, topk_positions_reference


def _check(q_packed, q_scale, k_packed, k_scale, weights, n_visible, pool_mask, pool_block):
    t, h, half = q_packed.shape
    n = k_packed.shape[0]
    d = 2 * half
    if k_packed.shape != (n, half) or q_scale.shape != (t, h, d // 32) or k_scale.shape != (n, d // 32):
        raise ValueError(f"indexer shapes disagree: q {tuple(q_packed.shape)} / {tuple(q_scale.shape)}, "
                         f"k {tuple(k_packed.shape)} / {tuple(k_scale.shape)}")
    if weights.shape != (t, h) or n_visible.shape != (t,):
        raise ValueError(f"weights must be [{t}, {h}] and n_visible [{t}]")
    if pool_mask is not None and pool_mask.shape != (t, -(-n // pool_block)):
        raise ValueError(f"pool_mask must be [{t}, {-(-n // pool_block)}], got {tuple(pool_mask.shape)}")
    return t, h, d, n


def indexer_scores_reference(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                             pool_mask=None, pool_block: int = 8) -> torch.Tensor:
    """float32 [T, N] scores (float64 arithmetic), -inf where masked."""
    t, h, d, n = _check(q_packed, q_scale, k_packed, k_scale, weights, n_visible, pool_mask, pool_block)
    q = Q.dequantize_fp4(q_packed.cpu(), q_scale.cpu(), 32).double()  # [T, H, D]
    k = Q.dequantize_fp4(k_packed.cpu(), k_scale.cpu(), 32).double()  # [N, D]
    s = torch.einsum("thd,nd->thn", q, k).clamp_min(0)
    s = torch.einsum("thn,th->tn", s, weights.cpu().double())
    allowed = torch.arange(n)[None, :] < n_visible.cpu().long()[:, None]
    if pool_mask is not None:
        allowed &= pool_mask.cpu().bool().repeat_interleave(pool_block, dim=1)[:, :n]
    return s.masked_fill(~allowed, float("-inf")).float().to(q_packed.device)


def indexer_topk_reference(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                           pool_mask=None, topk: int = 512, pool_block: int = 8) -> torch.Tensor:
    scores = indexer_scores_reference(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                                      pool_mask, pool_block)
    return topk_positions_reference(scores, topk)


# then each byte pair through f16 (exact), times the byte's f16 factor ($3: bytes 0-1, $4: bytes 2-3),
# rounded back to E4M3 (cvt.rn: the queries' rounding)
_E4M3_SHIFTED_ASM = tl.constexpr(E2M1_AS_E4M3_PTX + """
{
.reg .b16 x<4>;
.reg .b32 f<4>;
mov.b32 {x0, x1}, $0;
mov.b32 {x2, x3}, $1;
cvt.rn.f16x2.e4m3x2 f0, x0;
cvt.rn.f16x2.e4m3x2 f1, x1;
cvt.rn.f16x2.e4m3x2 f2, x2;
cvt.rn.f16x2.e4m3x2 f3, x3;
mul.rn.f16x2 f0, f0, $3;
mul.rn.f16x2 f1, f1, $4;
mul.rn.f16x2 f2, f2, $3;
mul.rn.f16x2 f3, f3, $4;
cvt.rn.satfinite.e4m3x2.f16x2 x0, f0;
cvt.rn.satfinite.e4m3x2.f16x2 x1, f1;
cvt.rn.satfinite.e4m3x2.f16x2 x2, f2;
cvt.rn.satfinite.e4m3x2.f16x2 x3, f3;
mov.b32 $0, {x0, x1};
mov.b32 $1, {x2, x3};
}
""")


@triton.jit
def _exp2(e):
    """float32 2^e for integer lanes e <= 127; 0 below 2^-126."""
    return tl.where(e > -127, (tl.maximum(e, -126) + 127) << 23, 0).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(v, FP8: tl.constexpr):
    """float32 -> E4M3, round to nearest even (float8e4nv operand; interpreter: its exact float32 value)."""
    if FP8:
        return v.to(tl.float8e4nv)
    else:
        return e4m3_value(e4m3_code(v))


@triton.jit
def _fp4_bytes_to_e4m3(b, ASM: tl.constexpr):
    """Packed FP4 bytes (uint8 [R, C]) -> E4M3 bytes (uint8 [R, 2C]) worth value * 2^-6 (_formats.e2m1_as_e4m3),
    natural K order."""
    lo, hi = e2m1_as_e4m3(b, ASM)
    return tl.join(lo, hi).reshape(b.shape[0], 2 * b.shape[1])


@triton.jit
def _key_raw(kp_ptr, ks_ptr, cols, kmask, g: tl.constexpr, NG: tl.constexpr, HALF: tl.constexpr,
             NGRP: tl.constexpr):
    """Keys' groups g..g+NG-1 as loaded: packed bytes int8 [BN, 16 NG] and scale bytes int32 [BN, NG]."""
    j = tl.arange(0, 16 * NG)
    b = tl.load(kp_ptr + cols[:, None].to(tl.int64) * HALF + g * 16 + j[None, :], mask=kmask[:, None], other=0)
    gi = g + tl.arange(0, NG)
    sc = tl.load(ks_ptr + cols[:, None].to(tl.int64) * NGRP + gi[None, :], mask=kmask[:, None], other=127)
    return b, sc.to(tl.int32)


@triton.jit
def _key_dot(b, sc, q, FP8: tl.constexpr, ASM: tl.constexpr):
    """One group's dot (the unfolded form): keys' E4M3 operand [BN, 32] worth value * 2^-6 x queries
    [32, NQ], the keys' scale applied to the fp32 result."""
    k = e4m3_operand(_fp4_bytes_to_e4m3(b.to(tl.uint8, bitcast=True), ASM), FP8)
    return tl.dot(k, q) * (e8m0_value(sc) * 64.0)


@triton.jit
def _key_folded(b, sc, FP8: tl.constexpr, ASM: tl.constexpr):
    """All of the keys' groups (bytes [BN, D/2], scale bytes [BN, D/32]) -> (E4M3 operand [BN, D] worth
    value * 2^(6 - s) rounded to nearest, s = the key's max group exponent - the group's, and the key's
    factor 2^(max exponent - 133) [BN]). Exact while s <= 14 (0.5 * 2^-8 is E4M3's least subnormal);
    beyond, values round to multiples of 2^-9 (a whole group is 0 from s = 19), as the queries do."""
    BN: tl.constexpr = b.shape[0]
    NG: tl.constexpr = sc.shape[1]
    kmax = tl.max(sc, axis=1)
    shift = kmax[:, None] - sc
    bg = tl.reshape(b.to(tl.uint8, bitcast=True), (BN, NG, 16))
    if ASM:  # factor 2^(12 - s) in f16: exact to s = 36, where every product already rounds to 0
        up = _exp2(12 - shift).to(tl.float16)
        lo, hi = tl.inline_asm_elementwise(_E4M3_SHIFTED_ASM, "=r,=r,r,r,r", [bg, up[:, :, None]],
                                           dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
        k = e4m3_operand(tl.join(lo, hi).reshape(BN, NG * 32), FP8)
    else:
        bi = bg.to(tl.int32)
        v = tl.join(fp4_value(bi & 15), fp4_value(bi >> 4)).reshape(BN, NG, 32) * _exp2(6 - shift)[:, :, None]
        k = tl.reshape(_e4m3(v, FP8), (BN, NG * 32))
    return k, e8m0_value(kmax) * 0.015625


@triton.jit
def _query_operand(qp_ptr, qs_ptr, rows, rmask, qmax, g: tl.constexpr, NG: tl.constexpr, HALF: tl.constexpr,
                   NGRP: tl.constexpr, FP8: tl.constexpr):
    """Queries' groups g..g+NG-1 -> operand [32 NG, NQ]: value * 2^(group exponent - row's max exponent
    + 6), rounded to E4M3: exact while a row's group exponents span at most 14."""
    NQ: tl.constexpr = rows.shape[0]
    j = tl.arange(0, 16 * NG)
    b = tl.load(qp_ptr + rows[:, None].to(tl.int64) * HALF + g * 16 + j[None, :], mask=rmask[:, None],
                other=0).to(tl.int32)
    gi = g + tl.arange(0, NG)
    ex = tl.load(qs_ptr + rows[:, None].to(tl.int64) * NGRP + gi[None, :], mask=rmask[:, None], other=127)
    f = _exp2(ex.to(tl.int32) - qmax[:, None] + 6)
    v = tl.join(fp4_value(b & 15), fp4_value((b >> 4) & 15)).reshape(NQ, NG, 32) * f[:, :, None]
    return tl.trans(tl.reshape(_e4m3(v, FP8), (NQ, NG * 32)))


@triton.jit
def _visible_score(acc, wq, kf, cols, t, n_vis, store_mask, pool_ptr, n_pool_cols, POOL_BLOCK: tl.constexpr,
                   HAS_POOL: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, H: tl.constexpr):
    """A tile's index scores [BN, BT] from the per-head dots acc [BN, BT*H]: ReLU, head weights, head
    sum, times the keys' factor kf [BN] (None: none); -inf where the entry is not visible to the query
    (or outside its candidate pool)."""
    s = tl.maximum(acc, 0.0) * wq[None, :]
    score = tl.sum(tl.reshape(s, (BN, BT, H)), axis=2)  # [BN, BT]
    if kf is not None:
        score = score * kf[:, None]
    allowed = cols[:, None] < n_vis[None, :]
    if HAS_POOL:
        pm = tl.load(pool_ptr + t[None, :] * n_pool_cols + cols[:, None] // POOL_BLOCK, mask=store_mask, other=0)
        allowed &= pm != 0
    return tl.where(allowed & store_mask, score, float("-inf"))


@triton.jit
def _indexer_kernel(qp_ptr, qs_ptr, kp_ptr, ks_ptr, w_ptr, nvis_ptr, pool_ptr, out_ptr, max_ptr, cnt_ptr,
                    T, N, n_pool_cols, stride_out, n_groups, chunk, POOL_BLOCK: tl.constexpr,
                    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, GM: tl.constexpr,
                    HAS_POOL: tl.constexpr, WRITE_MAX: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr,
                    PREFETCH: tl.constexpr = False, KEY_FOLD: tl.constexpr = False):
    """Scores of BT queries x `chunk` entries, E4M3 operands: one K = 32 dot per group, the key's group
    scale applied to each fp32 result. KEY_FOLD: each key's group exponents folded into its operand as
    the queries' are (_key_folded), one K = D dot per tile [BN, BT*H], and the key's remaining factor
    2^(kmax - 133) > 0 applied after the ReLU and head sum (ReLU commutes with it); exact with an exact
    fp32 dot (the interpreter) while every key's and query's group exponents span <= 14, not on the
    H200's FP8 MMA (module docstring).
    WRITE_MAX: also the maxima of groups of GM entries (powers of two, GM < BN or a multiple of BN)
    and zeroed top-k counters. PREFETCH (decode; D = 128, GM <= BN): the next tile's key bytes are
    loaded before this tile's dots, every tile is computed (keys past the last visible one are masked
    off, so never read)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    NQ: tl.constexpr = BT * H
    NGRP: tl.constexpr = D // 32
    HALF: tl.constexpr = D // 2
    r = pid_t * NQ + tl.arange(0, NQ)  # query-head rows
    rmask = r < T * H
    t = pid_t * BT + tl.arange(0, BT)
    t_mask = t < T
    n_vis = tl.load(nvis_ptr + t, mask=t_mask, other=0)
    if WRITE_MAX and pid_n == 0:
        tl.store(cnt_ptr + t, tl.zeros([BT], tl.int32), mask=t_mask)
    gi = tl.arange(0, NGRP)
    qmax = tl.max(tl.load(qs_ptr + r[:, None].to(tl.int64) * NGRP + gi[None, :], mask=rmask[:, None],
                          other=0).to(tl.int32), axis=1)
    # the rows' common factor 2^(qmax - 133) folded into the head weights (relu commutes with it)
    wq = tl.load(w_ptr + r, mask=rmask, other=0.0) * e8m0_value(qmax) * 0.015625
    if KEY_FOLD:
        q = _query_operand(qp_ptr, qs_ptr, r, rmask, qmax, 0, NGRP, HALF, NGRP, FP8)  # [D, NQ]
    else:
        q0 = _query_operand(qp_ptr, qs_ptr, r, rmask, qmax, 0, 1, HALF, NGRP, FP8)
        if NGRP > 1:
            q1 = _query_operand(qp_ptr, qs_ptr, r, rmask, qmax, 1, 1, HALF, NGRP, FP8)
        if NGRP > 2:
            q2 = _query_operand(qp_ptr, qs_ptr, r, rmask, qmax, 2, 1, HALF, NGRP, FP8)
            q3 = _query_operand(qp_ptr, qs_ptr, r, rmask, qmax, 3, 1, HALF, NGRP, FP8)
    vis_max = tl.max(n_vis, axis=0)
    n_start = pid_n * chunk
    if PREFETCH:
        n_end = tl.minimum(n_start + chunk, N)
        lim = tl.minimum(n_end, vis_max)
        cols = n_start + tl.arange(0, BN)
        if KEY_FOLD:
            b, sc = _key_raw(kp_ptr, ks_ptr, cols, cols < lim, 0, NGRP, HALF, NGRP)
        else:
            b0, s0 = _key_raw(kp_ptr, ks_ptr, cols, cols < lim, 0, 1, HALF, NGRP)
            b1, s1 = _key_raw(kp_ptr, ks_ptr, cols, cols < lim, 1, 1, HALF, NGRP)
            b2, s2 = _key_raw(kp_ptr, ks_ptr, cols, cols < lim, 2, 1, HALF, NGRP)
            b3, s3 = _key_raw(kp_ptr, ks_ptr, cols, cols < lim, 3, 1, HALF, NGRP)
        for n0 in range(n_start, n_end, BN):
            cols = n0 + tl.arange(0, BN)
            nxt = cols + BN
            if KEY_FOLD:
                b_next, sc_next = _key_raw(kp_ptr, ks_ptr, nxt, nxt < lim, 0, NGRP, HALF, NGRP)
                k, kf = _key_folded(b, sc, FP8, ASM)
                acc = tl.dot(k, q)
            else:
                c0, u0 = _key_raw(kp_ptr, ks_ptr, nxt, nxt < lim, 0, 1, HALF, NGRP)
                c1, u1 = _key_raw(kp_ptr, ks_ptr, nxt, nxt < lim, 1, 1, HALF, NGRP)
                c2, u2 = _key_raw(kp_ptr, ks_ptr, nxt, nxt < lim, 2, 1, HALF, NGRP)
                c3, u3 = _key_raw(kp_ptr, ks_ptr, nxt, nxt < lim, 3, 1, HALF, NGRP)
                kf = None
                acc = _key_dot(b0, s0, q0, FP8, ASM)
                acc += _key_dot(b1, s1, q1, FP8, ASM)
                acc += _key_dot(b2, s2, q2, FP8, ASM)
                acc += _key_dot(b3, s3, q3, FP8, ASM)
            store_mask = t_mask[None, :] & (cols[:, None] < N)
            score = _visible_score(acc, wq, kf, cols, t, n_vis, store_mask, pool_ptr, n_pool_cols,
                                   POOL_BLOCK, HAS_POOL, BN, BT, H)
            tl.store(out_ptr + t[None, :].to(tl.int64) * stride_out + cols[:, None], score, mask=store_mask)
            if WRITE_MAX:
                sg = n0 // GM + tl.arange(0, BN // GM)
                tl.store(max_ptr + t[None, :].to(tl.int64) * n_groups + sg[:, None],
                         tl.max(tl.reshape(score, (BN // GM, GM, BT)), axis=1),
                         mask=t_mask[None, :] & (sg[:, None] < n_groups))
            if KEY_FOLD:
                b, sc = b_next, sc_next
            else:
                b0, b1, b2, b3, s0, s1, s2, s3 = c0, c1, c2, c3, u0, u1, u2, u3
    else:
        STEP: tl.constexpr = GM if GM > BN else BN
        for g0 in range(n_start, tl.minimum(n_start + chunk, N), STEP):
            gmax = tl.full([BT], float("-inf"), tl.float32)
            for n0 in range(g0, g0 + STEP, BN):
                cols = n0 + tl.arange(0, BN)
                out_ptrs = out_ptr + t[None, :].to(tl.int64) * stride_out + cols[:, None]
                store_mask = t_mask[None, :] & (cols[:, None] < N)
                if n0 >= vis_max:  # nothing visible to any query of this tile: skip the keys
                    tl.store(out_ptrs, tl.full([BN, BT], float("-inf"), tl.float32), mask=store_mask)
                    if WRITE_MAX and GM < BN:
                        sg = n0 // GM + tl.arange(0, BN // GM)
                        tl.store(max_ptr + t[None, :].to(tl.int64) * n_groups + sg[:, None],
                                 tl.full([BN // GM, BT], float("-inf"), tl.float32),
                                 mask=t_mask[None, :] & (sg[:, None] < n_groups))
                else:
                    kmask = cols < N
                    if KEY_FOLD:
                        b, sc = _key_raw(kp_ptr, ks_ptr, cols, kmask, 0, NGRP, HALF, NGRP)
                        k, kf = _key_folded(b, sc, FP8, ASM)
                        acc = tl.dot(k, q)  # [BN, NQ]
                    else:
                        kf = None
                        acc = _key_dot(*_key_raw(kp_ptr, ks_ptr, cols, kmask, 0, 1, HALF, NGRP), q0, FP8, ASM)
                        if NGRP > 1:
                            acc += _key_dot(*_key_raw(kp_ptr, ks_ptr, cols, kmask, 1, 1, HALF, NGRP), q1, FP8, ASM)
                        if NGRP > 2:
                            acc += _key_dot(*_key_raw(kp_ptr, ks_ptr, cols, kmask, 2, 1, HALF, NGRP), q2, FP8, ASM)
                            acc += _key_dot(*_key_raw(kp_ptr, ks_ptr, cols, kmask, 3, 1, HALF, NGRP), q3, FP8, ASM)
                    score = _visible_score(acc, wq, kf, cols, t, n_vis, store_mask, pool_ptr, n_pool_cols,
                                           POOL_BLOCK, HAS_POOL, BN, BT, H)
                    tl.store(out_ptrs, score, mask=store_mask)
                    if WRITE_MAX:
                        if GM < BN:  # several groups per tile: their maxima stored with the tile
                            sg = n0 // GM + tl.arange(0, BN // GM)
                            tl.store(max_ptr + t[None, :].to(tl.int64) * n_groups + sg[:, None],
                                     tl.max(tl.reshape(score, (BN // GM, GM, BT)), axis=1),
                                     mask=t_mask[None, :] & (sg[:, None] < n_groups))
                        else:
                            gmax = tl.maximum(gmax, tl.max(score, axis=0))
            if WRITE_MAX and GM >= BN:
                tl.store(max_ptr + t.to(tl.int64) * n_groups + g0 // GM, gmax, mask=t_mask)


def _launch(q_packed, q_scale, k_packed, k_scale, weights, n_visible, pool_mask, pool_block, topk=None,
            block_t=None, block_n=None, chunk=None, num_warps=None, key_asm=None, groups=None,
            prefetch_keys=None, maxnreg=None, key_fold=False, rs=True, abs_scale=True, query_pairs=True):
    """One launch of _indexer_kernel -> (scores [T, N], maxima [T, n_groups] or None, counts or None). rs: the
    register-operand Gluon form (kernels/indexer_rs.py) where it applies (decode rows, D = 128, 32 heads, groups of
    64 keys or more, no pool; Hopper), its own chunk default; block_t, block_n, num_warps, key_* do not apply; abs_scale
    and query_pairs (`indexer_rs.indexer_scores_rs`) apply to it alone. All three on by default: rs, a 1M-key decode
    with its top-512 103.3 us against 111.8 (H100 run 44b); abs_scale with query_pairs 54.5 us against 63.8 (H100
    run 48a), exact for key scale bytes 66..192 (groups with amax between 6 x 2^-61 and 6 x 2^65, where the
    engine's normalized keys sit; an all-zero group's byte 1 scores 0 either way); its picks the reference's."""
    t, h, d, n = _check(q_packed, q_scale, k_packed, k_scale, weights, n_visible, pool_mask, pool_block)
    if d % 32 or d // 32 not in (1, 2, 4) or h & (h - 1):
        raise ValueError(f"indexer kernel takes D in (32, 64, 128) and a power-of-two head count, got {d}, {h}")
    dev = q_packed.device
    interp = interpreted()
    decode = t < 16
    bt = block_t or (1 if decode else max(1, 128 // h))
    bt = max(bt, 16 // h)  # the dot's N is at least 16
    bn = block_n or (128 if decode else 64)
    gm = bn
    if topk is not None:
        gm = _pow2(-(-n // max(_pow2(groups or default_groups(t)), 2 * topk)))
        gm = gm if gm < bn else max(gm, bn)
    step = max(gm, bn)
    prefetch = decode and d == 128 and gm <= bn
    asked_chunk = chunk
    if chunk is None:  # decode: ~6 programs per SM (2 waves at 3 resident); prefill: 4K entries (keys stay in
        # L2), fewer where the query blocks alone leave SMs idle (a 64-query decode step over 4K entries:
        # 16 programs at 4K, 126 us on the H200 in run 15c)
        n_sm = sm_count(dev)
        chunk = -(-n // (6 * n_sm)) if decode else min(4096, -(-n // max(1, 4 * n_sm // triton.cdiv(t, bt))))
    chunk = -(-max(chunk, step) // step) * step
    n_groups = triton.cdiv(n, gm)
    out = torch.empty(t, n, dtype=torch.float32, device=dev)
    maxima = torch.empty(t, n_groups, dtype=torch.float32, device=dev) if topk is not None else None
    counts = torch.empty(t, dtype=torch.int32, device=dev) if topk is not None else None
    rs_gm = gm if topk is not None else indexer_rs.BN
    if rs and not interp and indexer_rs.supports(t, h, d, n, rs_gm, pool_mask) \
            and (dev.type != "cuda" or indexer_rs.runs_on(dev)):  # (CPU tensors: the sm_90 compile bench)
        indexer_rs.indexer_scores_rs(q_packed, q_scale, k_packed, k_scale, weights, n_visible, out, maxima, counts,
                                     gm=rs_gm, chunk=asked_chunk, maxnreg=maxnreg, abs_scale=abs_scale,
                                     query_pairs=query_pairs)
        return out, maxima, counts
    pool = pool_mask.contiguous().view(torch.uint8) if pool_mask is not None else out
    _indexer_kernel[(triton.cdiv(t, bt), triton.cdiv(n, chunk))](
        q_packed.contiguous(), q_scale.contiguous().view(torch.uint8), k_packed.contiguous(),
        k_scale.contiguous().view(torch.uint8), weights.float().contiguous(),
        n_visible.to(torch.int32).contiguous(), pool, out, out if maxima is None else maxima,
        out if counts is None else counts, t, n,
        pool_mask.shape[1] if pool_mask is not None else 0, out.stride(0), n_groups, chunk,
        POOL_BLOCK=pool_block, H=h, D=d, BT=bt, BN=bn, GM=gm, HAS_POOL=pool_mask is not None,
        WRITE_MAX=topk is not None, FP8=not interp, ASM=(not interp) if key_asm is None else key_asm,
        PREFETCH=prefetch if prefetch_keys is None else prefetch_keys, KEY_FOLD=bool(key_fold),
        num_warps=num_warps or (8 if decode else 4),
        **register_cap(maxnreg))
    return out, maxima, counts


def indexer_scores_triton(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                          pool_mask=None, pool_block: int = 8, **tune) -> torch.Tensor:
    """float32 [T, N] scores, -inf where masked. tune: block_t, block_n, chunk, num_warps, key_asm,
    prefetch_keys (the decode loop; default for T < 16, D = 128), maxnreg (a register cap), key_fold
    (the keys' exponents in their operands: faster, not exact on the H200: module docstring). Decode runs
    8 warps a program: 136 vs 162 us at 4 (1M keys with its top-512, benches/results/kernels-h200-run8.md)."""
    return _launch(q_packed, q_scale, k_packed, k_scale, weights, n_visible, pool_mask, pool_block, **tune)[0]


def indexer_topk_triton(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                        pool_mask=None, topk: int = 512, pool_block: int = 8, cap: int = 2048,
                        rows_path: bool | None = None, select_tune: dict | None = None, **tune) -> torch.Tensor:
    """Scores with their group maxima in one launch, then kernels.topk.select_from_maxima: only the
    ~topk groups whose maximum reaches the bound are read again (tune: groups, and the scores' knobs;
    select_tune: the select's, e.g. its filter block)."""
    scores, maxima, counts = _launch(q_packed, q_scale, k_packed, k_scale, weights, n_visible, pool_mask,
                                     pool_block, topk=topk, **tune)
    vis = n_visible.to(device=scores.device, dtype=torch.int32).contiguous()
    return select_from_maxima(scores, topk, vis, maxima, counts, cap=cap, rows_path=rows_path, **(select_tune or {}))
