"""Fused single-pass mHC (manifold-constrained hyper-connections, 4 copies of the stream).

Per token, in one read of the stream (programs split tokens and d; see the kernels' notes below):
  [optional post/comb update]  Xn[j] = post_old[j] * y + sum_i comb_old[i, j] * X[i]   (stored, X's dtype)
  collapse                     x = sum_c pre_prev[c] * Xn[c]                           (X's dtype)
  mixes                        m = (flatten(Xn) @ fn^T) * rsqrt(mean(Xn^2) + norm_eps)   (24 values)
  pre = sigmoid(m[0:4] s0 + b) + hc_eps;  post = 2 sigmoid(m[4:8] s1 + b)
  comb = softmax_rows(m[8:24] s2 + b) + hc_eps, columns / (sum + hc_eps), then 19 rounds rows-then-columns.
Shapes: X [T, 4, dim], fn float32 [24, 4*dim], scale [3], base [24], pre_prev [T, 4], y [T, dim],
post_old [T, 4], comb_old [T, 4, 4]. Returns (Xn or None, x [T, dim], pre [T, 4], post [T, 4], comb [T, 4, 4]).
Mixes to fp32 accuracy: a bf16 stream is exact in bf16, so fn is cut (once per weight, cached:
`mhc_fn_pieces`) into 3 bf16 pieces stacked as the rows of one bf16 tensor-core dot per d chunk, with
the four updated stream tiles joined along K as its B operand and the tokens as its N side (fp32
streams: fn itself, one tf32x3 dot); below 9 tokens plain fp32 FMAs. 1 token: 160 programs over d, the
last to finish sums the partials and runs the Sinkhorn (one launch, latency-bound); 4K tokens: 64-token
blocks x 2 d splits of 64-wide chunks (HBM-bound: X, y read once, X' and x written once, fn's pieces
re-read from L2 per block), each block finished by its last program. Launch shapes: `mhc_plan`.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from kernels._formats import cast_rne, dot_dtype, sm_count


def _check(x, fn, scale, base, pre_prev, y, post_old, comb_old):
    if x.dim() != 3 or x.shape[1] != 4:
        raise ValueError(f"mHC stream must be [T, 4, dim], got {tuple(x.shape)}")
    t, _, dim = x.shape
    if fn.shape != (24, 4 * dim) or scale.shape != (3,) or base.shape != (24,) or pre_prev.shape != (t, 4):
        raise ValueError(f"mHC parameters must be fn [24, {4 * dim}], scale [3], base [24], pre_prev [{t}, 4]")
    if (y is None) != (post_old is None) or (y is None) != (comb_old is None):
        raise ValueError("y, post_old and comb_old come together (the post/comb update) or not at all")
    if y is not None and (y.shape != (t, dim) or post_old.shape != (t, 4) or comb_old.shape != (t, 4, 4)):
        raise ValueError("y must be [T, dim], post_old [T, 4], comb_old [T, 4, 4]")
    return t, dim


def sinkhorn_split_reference(m, scale, base, hc_eps=1e-6, iters=20):
    """m [..., 24] -> pre [..., 4], post [..., 4], comb [..., 4, 4] (the dtype of m)."""
    pre = torch.sigmoid(m[..., 0:4] * scale[0] + base[0:4]) + hc_eps
    post = 2 * torch.sigmoid(m[..., 4:8] * scale[1] + base[4:8])
    comb = (m[..., 8:24] * scale[2] + base[8:24]).unflatten(-1, (4, 4))
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_reference(x, fn, scale, base, pre_prev, y=None, post_old=None, comb_old=None,
                  norm_eps=1e-20, hc_eps=1e-6, iters=20, bf16_values: bool = False):
    """bf16_values: x is float32 holding bf16 values; the update and the collapse are rounded to bf16 values
    and kept float32 (what a bf16 stream stores, in the engine's float32 tensors)."""
    t, dim = _check(x, fn, scale, base, pre_prev, y, post_old, comb_old)
    cdt = torch.float64 if x.device.type == "cpu" else torch.float32
    stored = (lambda v: v.to(torch.bfloat16).to(x.dtype)) if bf16_values else (lambda v: v.to(x.dtype))  # noqa: E731
    xs = x.to(cdt)
    xn = None
    if y is not None:
        xs = post_old.to(cdt)[..., None] * y.to(cdt)[:, None, :] \
            + torch.einsum("tij,tid->tjd", comb_old.to(cdt), xs)
        xn = stored(xs)
        xs = xn.to(cdt)
    collapse = stored(torch.einsum("tc,tcd->td", pre_prev.to(cdt), xs))
    flat = xs.flatten(1)
    m = (flat @ fn.to(cdt).T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre, post, comb = sinkhorn_split_reference(m, scale.to(cdt), base.to(cdt), hc_eps, iters)
    return xn, collapse, pre.float(), post.float(), comb.float()


# -- kernels --------------------------------------------------------------------------------------
# Work split: programs own (a block of BT tokens) x (a contiguous run of BD-wide d chunks). The update
# and the collapse are elementwise in d, so each program stores its slice of X' and x directly; only
# the 24 mixes and the sum of squares need the whole 4*dim row. An FMA-path program with one d split
# finishes its tokens itself (RMS, sigmoid/softmax, Sinkhorn in registers). Otherwise each program
# writes its partial sums to a [splits, T, 32] workspace and bumps its token block's counter; the
# program that arrives last sums the block's partials and finishes (one launch; `finish="launch"`
# keeps the older second launch). Workspace / accumulator columns (32): mixes 0..23 (pre 0..3,
# post 4..7, comb 8..23 row-major), 24 the sum of squares, 25..31 unused.


@triton.jit
def _col(acc, K: tl.constexpr):
    """Column K of acc [BT, 32] as a [BT] vector."""
    return tl.sum(tl.where(tl.arange(0, 32)[None, :] == K, acc, 0.0), axis=1)


@triton.jit
def _scaled(acc, K: tl.constexpr, rs, s, base_ptr):
    """The pre-activation of mix K: mix * rsqrt-norm * scale + base."""
    return _col(acc, K) * rs * s + tl.load(base_ptr + K)


@triton.jit
def _norm4(a, b, c, d, eps):
    inv = 1.0 / (((a + b) + (c + d)) + eps)  # a tree: 2 dependent adds, not 3, on the serial chain
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _softmax4(a, b, c, d, eps):
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a = tl.exp(a - m)
    b = tl.exp(b - m)
    c = tl.exp(c - m)
    d = tl.exp(d - m)
    inv = 1.0 / ((a + b) + (c + d))
    return a * inv + eps, b * inv + eps, c * inv + eps, d * inv + eps


@triton.jit
def _finish(acc, t, tm, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps, hc_eps,
            DIM: tl.constexpr, ITERS: tl.constexpr):
    """acc [BT, 32] fp32 (columns as above) -> pre, post [T, 4] and comb [T, 4, 4] stored.

    Every value is a [BT] vector (one per matrix entry), so the 20 Sinkhorn rounds are in-thread
    adds and multiplies along each token's dependency chain, no cross-lane reductions."""
    rs = 1.0 / tl.sqrt(_col(acc, 24) / (4 * DIM) + norm_eps)
    s0 = tl.load(scale_ptr + 0)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    for j in tl.static_range(4):
        zp = _scaled(acc, j, rs, s0, base_ptr)
        zq = _scaled(acc, 4 + j, rs, s1, base_ptr)
        tl.store(pre_ptr + t * 4 + j, 1.0 / (1.0 + tl.exp(-zp)) + hc_eps, mask=tm)
        tl.store(post_ptr + t * 4 + j, 2.0 / (1.0 + tl.exp(-zq)), mask=tm)
    # comb[i][j] = mix 8 + 4i + j: softmax over j, then columns
    c00, c01, c02, c03 = _softmax4(_scaled(acc, 8, rs, s2, base_ptr), _scaled(acc, 9, rs, s2, base_ptr),
                                   _scaled(acc, 10, rs, s2, base_ptr), _scaled(acc, 11, rs, s2, base_ptr), hc_eps)
    c10, c11, c12, c13 = _softmax4(_scaled(acc, 12, rs, s2, base_ptr), _scaled(acc, 13, rs, s2, base_ptr),
                                   _scaled(acc, 14, rs, s2, base_ptr), _scaled(acc, 15, rs, s2, base_ptr), hc_eps)
    c20, c21, c22, c23 = _softmax4(_scaled(acc, 16, rs, s2, base_ptr), _scaled(acc, 17, rs, s2, base_ptr),
                                   _scaled(acc, 18, rs, s2, base_ptr), _scaled(acc, 19, rs, s2, base_ptr), hc_eps)
    c30, c31, c32, c33 = _softmax4(_scaled(acc, 20, rs, s2, base_ptr), _scaled(acc, 21, rs, s2, base_ptr),
                                   _scaled(acc, 22, rs, s2, base_ptr), _scaled(acc, 23, rs, s2, base_ptr), hc_eps)
    for it in tl.static_range(ITERS):
        if it > 0:  # rows (the first round's row step is the softmax)
            c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, hc_eps)
            c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, hc_eps)
            c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, hc_eps)
            c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps)
    o = comb_ptr + t * 16
    tl.store(o + 0, c00, mask=tm)
    tl.store(o + 1, c01, mask=tm)
    tl.store(o + 2, c02, mask=tm)
    tl.store(o + 3, c03, mask=tm)
    tl.store(o + 4, c10, mask=tm)
    tl.store(o + 5, c11, mask=tm)
    tl.store(o + 6, c12, mask=tm)
    tl.store(o + 7, c13, mask=tm)
    tl.store(o + 8, c20, mask=tm)
    tl.store(o + 9, c21, mask=tm)
    tl.store(o + 10, c22, mask=tm)
    tl.store(o + 11, c23, mask=tm)
    tl.store(o + 12, c30, mask=tm)
    tl.store(o + 13, c31, mask=tm)
    tl.store(o + 14, c32, mask=tm)
    tl.store(o + 15, c33, mask=tm)


@triton.jit
def _sum_parts(part_ptr, t64, tm, T, KS, BT: tl.constexpr, KSB: tl.constexpr):
    """The [BT, 32] sum over the KS partials of tokens t64, KSB splits per load, in a fixed order.

    `.cg` loads: the partials were written by other programs (and by earlier launches at the same
    addresses), so they are read from L2, never from a possibly stale L1 line."""
    r32 = tl.arange(0, 32)
    rk = tl.arange(0, KSB)
    acc = tl.zeros([BT, 32], tl.float32)
    for s0 in range(0, KS, KSB):
        s = s0 + rk
        po = (s.to(tl.int64)[:, None, None] * T + t64[None, :, None]) * 32 + r32[None, None, :]
        m3 = (s[:, None, None] < KS) & tm[None, :, None]
        acc += tl.sum(tl.load(part_ptr + po, mask=m3, other=0.0, cache_modifier=".cg"), axis=0)
    return acc


@triton.jit
def _stored(v, out_ty: tl.constexpr, RND: tl.constexpr):
    """float32 v as the stream stores it: in its dtype, or (RND: a float32 stream of bf16 values) rounded to
    bf16 values and kept float32."""
    if RND:
        return cast_rne(v, tl.bfloat16).to(tl.float32)
    else:
        return cast_rne(v, out_ty)


@triton.jit
def _update(yv, x0, x1, x2, x3, p, ca, cb, cc, cd, out_ty: tl.constexpr, RND: tl.constexpr):
    """One stream of the post/comb update, as the stream stores it (the mixes and the collapse see the
    stored stream): p y + ca x0 + cb x1 + cc x2 + cd x3 ([BT] coefficients, [BT, BD] tiles)."""
    v = p[:, None] * yv + ca[:, None] * x0 + cb[:, None] * x1 + cc[:, None] * x2 + cd[:, None] * x3
    return _stored(v, out_ty, RND)


@triton.jit
def _mhc_main_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, prep_ptr, y_ptr, posto_ptr, combo_ptr,
                     xn_ptr, xc_ptr, part_ptr, cnt_ptr, pre_ptr, post_ptr, comb_ptr, T, KS, CPS, norm_eps, hc_eps,
                     DIM: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ITERS: tl.constexpr,
                     HAS_POST: tl.constexpr, USE_DOT: tl.constexpr, NP: tl.constexpr, MR: tl.constexpr,
                     DOT_DT: tl.constexpr, PREC: tl.constexpr, FINISH: tl.constexpr, KSB: tl.constexpr,
                     TOKENS_M: tl.constexpr = False, RND: tl.constexpr = False):
    """FINISH: 0 partials only (a second launch finishes), 1 finish in registers (one d split),
    2 partials and the last program of the token block to arrive finishes. RND: the stream is float32 of
    bf16 values; the update and the collapse are stored so (`_stored`), and its tiles are exact bf16 operands.

    USE_DOT: fn_ptr is `mhc_fn_pieces(fn, NP)`: NP pieces x 24 rows, stream-interleaved columns
    (column 4 d + j = fn[:, j dim + d]), so chunk ci's A operand is one contiguous [rows, 4 BD] tile
    (row r of the MR-row tile = piece r // 32, mix r % 32; mixes 24..31 masked to zero) loaded straight
    into the dot (pipelined, no arithmetic on it), and the B operand is the four updated stream tiles
    joined into one [BT, 4 BD] tile: one dot per chunk. Otherwise fn_ptr is fn [24, 4 dim] fp32 and
    the mixes are FMAs.

    TOKENS_M (dot path, run 4's candidate): the other orientation. The joined stream tile is the
    wgmma's register A operand (M = BT tokens) and each fn piece's [32, 4 BD] tile (mixes 24..31
    masked) the shared-memory B operand (N = 32 mixes), NP dots per chunk into one [BT, 32]
    accumulator: no shared-memory copy of the stream tile, 48 KB of fn per stage instead of 64 KB
    (3 pieces x 32 rows, not 128 rows of which 72 are used), 8 accumulator registers instead of 32."""
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    tm = t < T
    t64 = t.to(tl.int64)
    # per-token coefficients, loaded once for the whole d range
    q0 = tl.load(prep_ptr + t * 4 + 0, mask=tm, other=0.0)
    q1 = tl.load(prep_ptr + t * 4 + 1, mask=tm, other=0.0)
    q2 = tl.load(prep_ptr + t * 4 + 2, mask=tm, other=0.0)
    q3 = tl.load(prep_ptr + t * 4 + 3, mask=tm, other=0.0)
    if HAS_POST:
        p0 = tl.load(posto_ptr + t * 4 + 0, mask=tm, other=0.0)
        p1 = tl.load(posto_ptr + t * 4 + 1, mask=tm, other=0.0)
        p2 = tl.load(posto_ptr + t * 4 + 2, mask=tm, other=0.0)
        p3 = tl.load(posto_ptr + t * 4 + 3, mask=tm, other=0.0)
        c00 = tl.load(combo_ptr + t * 16 + 0, mask=tm, other=0.0)  # c_ij: from stream i to stream j
        c01 = tl.load(combo_ptr + t * 16 + 1, mask=tm, other=0.0)
        c02 = tl.load(combo_ptr + t * 16 + 2, mask=tm, other=0.0)
        c03 = tl.load(combo_ptr + t * 16 + 3, mask=tm, other=0.0)
        c10 = tl.load(combo_ptr + t * 16 + 4, mask=tm, other=0.0)
        c11 = tl.load(combo_ptr + t * 16 + 5, mask=tm, other=0.0)
        c12 = tl.load(combo_ptr + t * 16 + 6, mask=tm, other=0.0)
        c13 = tl.load(combo_ptr + t * 16 + 7, mask=tm, other=0.0)
        c20 = tl.load(combo_ptr + t * 16 + 8, mask=tm, other=0.0)
        c21 = tl.load(combo_ptr + t * 16 + 9, mask=tm, other=0.0)
        c22 = tl.load(combo_ptr + t * 16 + 10, mask=tm, other=0.0)
        c23 = tl.load(combo_ptr + t * 16 + 11, mask=tm, other=0.0)
        c30 = tl.load(combo_ptr + t * 16 + 12, mask=tm, other=0.0)
        c31 = tl.load(combo_ptr + t * 16 + 13, mask=tm, other=0.0)
        c32 = tl.load(combo_ptr + t * 16 + 14, mask=tm, other=0.0)
        c33 = tl.load(combo_ptr + t * 16 + 15, mask=tm, other=0.0)
    sq = tl.zeros([BT, BD], tl.float32)  # squares and FMA products are reduced once, after the loop
    m2 = tm[:, None]
    r32 = tl.arange(0, 32)
    if USE_DOT and TOKENS_M:
        acc = tl.zeros([BT, 32], tl.float32)
        f_off = r32[:, None] * (4 * DIM) + tl.arange(0, 4 * BD)[None, :]  # one piece's [32, 4 BD] tile
        f_ok = (r32 < 24)[:, None]
    elif USE_DOT:
        acc_t = tl.zeros([MR, BT], tl.float32)  # transposed; MR // 32 row blocks, one per fn piece
        rm = tl.arange(0, MR)
        a_ok = ((rm // 32) < NP) & ((rm % 32) < 24)
        a_off = ((rm // 32) * 24 + rm % 32)[:, None] * (4 * DIM) + tl.arange(0, 4 * BD)[None, :]
    else:
        acc3 = tl.zeros([BT, 32, BD], tl.float32)
        # rows 24..31 repeat mix 23 (unmasked loads stay 16-byte vectors); their columns are unused
        f_row = tl.minimum(r32, 23)
    c_lo = pid_k * CPS
    c_hi = tl.minimum(c_lo + CPS, DIM // BD)
    for ci in range(c_lo, c_hi):
        d = ci * BD + tl.arange(0, BD)
        xoff = t64[:, None] * (4 * DIM) + d[None, :]
        x0q = tl.load(x_ptr + xoff, mask=m2, other=0.0)
        x1q = tl.load(x_ptr + xoff + DIM, mask=m2, other=0.0)
        x2q = tl.load(x_ptr + xoff + 2 * DIM, mask=m2, other=0.0)
        x3q = tl.load(x_ptr + xoff + 3 * DIM, mask=m2, other=0.0)
        if USE_DOT and TOKENS_M:
            pass  # the fn pieces are loaded next to their dots
        elif USE_DOT:
            a = tl.load(fn_ptr + a_off + ci * (4 * BD), mask=a_ok[:, None], other=0.0)
        else:
            fo = f_row[:, None] * (4 * DIM) + d[None, :]
            f0 = tl.load(fn_ptr + fo)
            f1 = tl.load(fn_ptr + fo + DIM)
            f2 = tl.load(fn_ptr + fo + 2 * DIM)
            f3 = tl.load(fn_ptr + fo + 3 * DIM)
        if HAS_POST:
            yv = tl.load(y_ptr + t64[:, None] * DIM + d[None, :], mask=m2, other=0.0).to(tl.float32)
            x0 = x0q.to(tl.float32)
            x1 = x1q.to(tl.float32)
            x2 = x2q.to(tl.float32)
            x3 = x3q.to(tl.float32)
            sty = xn_ptr.dtype.element_ty
            n0 = _update(yv, x0, x1, x2, x3, p0, c00, c10, c20, c30, sty, RND)
            n1 = _update(yv, x0, x1, x2, x3, p1, c01, c11, c21, c31, sty, RND)
            n2 = _update(yv, x0, x1, x2, x3, p2, c02, c12, c22, c32, sty, RND)
            n3 = _update(yv, x0, x1, x2, x3, p3, c03, c13, c23, c33, sty, RND)
            tl.store(xn_ptr + xoff, n0, mask=m2)
            tl.store(xn_ptr + xoff + DIM, n1, mask=m2)
            tl.store(xn_ptr + xoff + 2 * DIM, n2, mask=m2)
            tl.store(xn_ptr + xoff + 3 * DIM, n3, mask=m2)
        else:
            n0, n1, n2, n3 = x0q, x1q, x2q, x3q
        v0 = n0.to(tl.float32)
        v1 = n1.to(tl.float32)
        v2 = n2.to(tl.float32)
        v3 = n3.to(tl.float32)
        sq += v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3
        col = q0[:, None] * v0 + q1[:, None] * v1 + q2[:, None] * v2 + q3[:, None] * v3
        tl.store(xc_ptr + t64[:, None] * DIM + d[None, :], _stored(col, xc_ptr.dtype.element_ty, RND), mask=m2)
        if USE_DOT and TOKENS_M:
            xa = tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), (BT, 4 * BD)).to(DOT_DT)
            for pc in tl.static_range(NP):
                fb = tl.load(fn_ptr + f_off + (pc * 24 * 4 * DIM + ci * 4 * BD), mask=f_ok, other=0.0)
                if NP == 1:
                    acc = tl.dot(xa, tl.trans(fb.to(DOT_DT)), acc, input_precision=PREC)
                else:
                    acc = tl.dot(xa, tl.trans(fb.to(DOT_DT)), acc)
        elif USE_DOT:
            # column 4 d + j of the joined tile is stream j at d (the interleave of mhc_fn_pieces)
            b = tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), (BT, 4 * BD))
            if NP == 1:
                acc_t = tl.dot(a.to(DOT_DT), tl.trans(b.to(DOT_DT)), acc_t, input_precision=PREC)
            else:
                acc_t = tl.dot(a.to(DOT_DT), tl.trans(b.to(DOT_DT)), acc_t)
        else:
            acc3 += v0[:, None, :] * f0[None, :, :] + v1[:, None, :] * f1[None, :, :] \
                + v2[:, None, :] * f2[None, :, :] + v3[:, None, :] * f3[None, :, :]
    if USE_DOT and TOKENS_M:
        pass
    elif USE_DOT:
        acc = tl.trans(tl.sum(tl.reshape(acc_t, (MR // 32, 32, BT)), axis=0))
    else:
        acc = tl.sum(acc3, axis=2)
    acc = tl.where(r32[None, :] == 24, tl.sum(sq, axis=1)[:, None], acc)
    if FINISH == 1:
        _finish(acc, t, tm, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps, hc_eps, DIM, ITERS)
    else:
        tl.store(part_ptr + (pid_k * T + t64)[:, None] * 32 + r32[None, :], acc, mask=m2)
        if FINISH == 2:
            # all of this program's partial stores happen before the counter's release (the
            # barrier), and the last arriver's acquire happens before its reads of all of them
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
            if arrived == KS - 1:
                tot = _sum_parts(part_ptr, t64, tm, T, KS, BT, KSB)
                _finish(tot, t, tm, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps, hc_eps,
                        DIM, ITERS)
                tl.store(cnt_ptr + pid_t, 0)  # ready for the next launch (stream order)


@triton.jit
def _mhc_finish_kernel(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, KS, norm_eps, hc_eps,
                       DIM: tl.constexpr, BT: tl.constexpr, KSB: tl.constexpr, ITERS: tl.constexpr):
    """Sums the [KS, T, 32] partials of BT tokens (KSB splits per vector load) and finishes them."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    acc = _sum_parts(part_ptr, t.to(tl.int64), tm, T, KS, BT, KSB)
    _finish(acc, t, tm, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, norm_eps, hc_eps, DIM, ITERS)


# -- launch ---------------------------------------------------------------------------------------

_PIECES: dict = {}    # id(fn) -> (weakref to fn, fn._version, pieces, prepared tensor)
_COUNTERS: dict = {}  # device -> int32 zeros, one arrival counter per token block


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def mhc_fn_pieces(fn, pieces: int):
    """fn [24, 4*dim] fp32 -> the dot path's A operand [24 * max(1, pieces), 4*dim].

    Columns interleaved by stream (column 4 d + j = fn[:, j*dim + d]), so a d chunk of all four streams
    is one contiguous run per row. pieces 2/3 (bf16 streams): fn = hi + mid [+ lo], bf16 pieces stacked
    by rows, each the bf16 rounding of the previous remainder (exact in fp32; error 2^-17 / 2^-26 of
    |fn|); 0: fn itself in fp32 (one tf32x3 dot for fp32 streams)."""
    dim = fn.shape[1] // 4
    f = fn.float().reshape(24, 4, dim).transpose(1, 2).reshape(24, 4 * dim)
    if pieces == 0:
        return f.contiguous()
    out, r = [], f
    for _ in range(pieces):
        p = r.bfloat16()
        out.append(p)
        r = r - p.float()
    return torch.cat(out).contiguous()


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place version; -1 for an inference-mode tensor, which has none (weights loaded
    under torch.inference_mode are not written in place after loading)."""
    return -1 if t.is_inference() else t._version


def _cached_pieces(fn, pieces: int):
    """mhc_fn_pieces for a weight, made once per tensor and version (fn is a model parameter)."""
    version = _version(fn)
    hit = _PIECES.get(id(fn))
    if hit is not None and hit[0]() is fn and hit[1] == version and hit[2] == pieces:
        return hit[3]
    prepared = mhc_fn_pieces(fn, pieces)
    key = id(fn)
    try:
        ref = weakref.ref(fn, lambda _r, k=key: _PIECES.pop(k, None))
    except TypeError:  # not weak-referenceable: no caching
        return prepared
    _PIECES[key] = (ref, version, pieces, prepared)
    return prepared


def _counters(dev, n: int):
    """n zeroed arrival counters on dev (each finishing program resets its own, so they stay zero
    between launches). One set per device: launches sharing it must be stream-ordered."""
    buf = _COUNTERS.get(dev)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=dev)
        _COUNTERS[dev] = buf
    return buf


def _parts_per_load(ks: int, bt: int) -> int:
    """Partials summed per vector load by a finishing program: 8K values at 1-2 tokens (one load for
    1 token's 160 splits), 2K from 16 tokens (a [KSB, BT, 32] load above that spills the epilogue)."""
    return min(_pow2_at_least(ks), max(1, (8192 if bt <= 2 else 2048) // (bt * 32)))


def mhc_plan(t: int, dim: int, device, block_d: int | None = None, token_block: int | None = None,
             split_k: int | None = None, waves: float | None = None):
    """The launch shape for T tokens: (token block, FMA or dot, d block, d splits, chunks per split).

    Below 9 tokens the mixes are fp32 FMAs over a small token block (a dot's 16+ rows would be mostly
    padding) and d is split as finely as `waves` (default 4) programs per SM allow: 1 token at dim 5120
    is 160 programs of one 32-wide chunk. From 9 tokens they are tensor-core dots over 16-token
    blocks, 32-token blocks from 32 tokens (the 64-token decode step: 25.1 us against 40.3 at 16-token
    blocks, H200 run 13), 64 from 2K; d is split only to fill `waves` (default 1) waves.
    d chunks (block_d) default to 32, 64 for 64-token blocks: 128 contiguous bytes of each bf16 row per
    step and half the steps; 4K tokens: 64 blocks x 2 splits = 128 programs of 40 chunks."""
    if token_block is None:
        token_block = t if t < 16 else (16 if t < 32 else 32 if t < 2048 else 64)
    if block_d is None:
        block_d = 64 if token_block >= 64 else 32
    bd = min(block_d, dim)
    if dim % bd or bd & (bd - 1):
        raise ValueError(f"dim {dim} must be a multiple of the d block {bd} (a power of two)")
    bt = _pow2_at_least(token_block)
    use_dot = bt >= 16
    nch = dim // bd
    tblocks = triton.cdiv(t, bt)
    if split_k is None:
        w = waves if waves is not None else (1.0 if use_dot else 4.0)
        split_k = max(1, int(w * sm_count(device)) // tblocks)
    cps = triton.cdiv(nch, max(1, min(int(split_k), nch)))
    return bt, use_dot, bd, triton.cdiv(nch, cps), cps


def mhc_triton(x, fn, scale, base, pre_prev, y=None, post_old=None, comb_old=None,
               norm_eps=1e-20, hc_eps=1e-6, iters=20, block_t: int | None = None, block_d: int | None = None,
               precision: str = "tf32x3", num_warps: int | None = None, *, token_block: int | None = None,
               split_k: int | None = None, split: int | None = None, num_stages: int | None = None,
               finish_block_t: int | None = None, waves: float | None = None, finish: str = "last",
               orient: str = "mixes", bf16_values: bool = False):
    """The fused mHC (see the module docstring); the outputs of `mhc_reference`.

    Tuning: token_block (tokens per program), block_d (d chunk), split_k (programs along d), waves
    (auto split_k: programs per SM), split (bf16 streams: 3 or 2 bf16 pieces of fn per dot; 0: one fp32
    dot at `precision`), num_warps, num_stages, finish ("last": the last program of each token block
    finishes it, one launch; "launch": a second launch of finish_block_t tokens per program). The FMA
    path with one d split finishes in registers. `block_t` is the obsolete name of token_block from the
    one-launch kernel and is ignored (the block follows T). The dot path's fn pieces are made once per
    fn tensor (and version) and cached (`mhc_fn_pieces`). orient (dot path): "mixes" (fn pieces as the
    MMA's M, tokens as N: the default) or "tokens" (tokens as M from registers, each fn piece as B:
    see the kernel's TOKENS_M). bf16_values: x (and y) float32 holding bf16 values, as the engine keeps the
    `reference` numerics' stream: read as they are (no bf16 copy made first), taken as exact bf16 dot
    operands as a bf16 stream is, the update and the collapse rounded to bf16 values and stored float32
    (no widening copy after): the same values as the bf16 stream's outputs."""
    del block_t
    t, dim = _check(x, fn, scale, base, pre_prev, y, post_old, comb_old)
    if bf16_values and x.dtype != torch.float32:
        raise ValueError(f"bf16_values describes a float32 stream, got {x.dtype}")
    if finish not in ("last", "launch"):
        raise ValueError(f"finish must be 'last' or 'launch', got {finish!r}")
    if orient not in ("mixes", "tokens"):
        raise ValueError(f"orient must be 'mixes' or 'tokens', got {orient!r}")
    dev = x.device
    xc = torch.empty(t, dim, dtype=x.dtype, device=dev)
    xn = torch.empty_like(x) if y is not None else None
    pre = torch.empty(t, 4, dtype=torch.float32, device=dev)
    post = torch.empty(t, 4, dtype=torch.float32, device=dev)
    comb = torch.empty(t, 4, 4, dtype=torch.float32, device=dev)
    if t == 0:
        return xn, xc, pre, post, comb
    if block_d is None and bf16_values:  # the bf16 stream's bytes a step (its 64-wide chunks of a 64-token block
        block_d = 32  # in float32 spill 424 bytes and ask for 240 KB of shared memory on sm_90: past the 227 KB)
    bt, use_dot, bd, ks, cps = mhc_plan(t, dim, dev, block_d, token_block, split_k, waves)
    dot_dt = dot_dtype()
    if split is None:
        split = 3 if ((x.dtype == torch.bfloat16 or bf16_values) and dot_dt == tl.bfloat16) else 0
    if split not in (0, 2, 3):
        raise ValueError(f"split must be 0, 2 or 3 bf16 pieces, got {split}")
    if split and x.dtype != torch.bfloat16 and not bf16_values:
        raise ValueError("the bf16 split of fn needs a bf16 stream (its values are exact bf16 dot operands)")
    tblocks = triton.cdiv(t, bt)
    mode = 1 if (ks == 1 and not use_dot) else (2 if finish == "last" else 0)
    part = pre if mode == 1 else torch.empty(ks, t, 32, dtype=torch.float32, device=dev)
    cnt = _counters(dev, tblocks) if mode == 2 else pre
    f32 = lambda v: v.float().contiguous()
    scale32, base32 = f32(scale), f32(base)
    fa = _cached_pieces(fn, split) if use_dot else f32(fn)
    # 64 x 64 stream tiles: 2 stages (3 would need 300 KB of shared memory for the A operand's buffers)
    ns = num_stages if num_stages is not None else ((2 if bt * bd >= 4096 else 3) if use_dot else 1)
    nw = num_warps if num_warps is not None else (8 if use_dot and bt >= 32 else 4)
    _mhc_main_kernel[(tblocks, ks)](
        x.contiguous(), fa, scale32, base32, f32(pre_prev),
        y.contiguous() if y is not None else x, f32(post_old) if y is not None else pre,
        f32(comb_old) if y is not None else comb, xn if xn is not None else xc, xc, part, cnt, pre, post, comb,
        t, ks, cps, float(norm_eps), float(hc_eps), DIM=dim, BT=bt, BD=bd, ITERS=iters, HAS_POST=y is not None,
        USE_DOT=use_dot, NP=max(1, split), MR=128 if split == 3 else 64, DOT_DT=dot_dt, PREC=precision,
        FINISH=mode, KSB=_parts_per_load(ks, bt), TOKENS_M=orient == "tokens", RND=bf16_values, num_warps=nw,
        num_stages=ns)
    if mode == 0:
        fbt = finish_block_t or min(32, _pow2_at_least(t))
        ksb = _parts_per_load(ks, fbt)
        _mhc_finish_kernel[(triton.cdiv(t, fbt),)](
            part, scale32, base32, pre, post, comb, t, ks, float(norm_eps), float(hc_eps),
            DIM=dim, BT=fbt, KSB=ksb, ITERS=iters, num_warps=4)
    return xn, xc, pre, post, comb


# -- the stream update alone (the FFN's, which no later collapse in the same block fuses) -------------

def mhc_expand_reference(y, residual, post, comb, bf16_out: bool = False):
    """engine/ops/reference.py ReferenceOps.expand: X'[j] = sum_i comb[i, j] X[i] + post[j] y in float32, in
    that order, rounded to bf16 values (bf16_out: stored bf16). y [T, dim], residual [T, 4, dim], post [T, 4],
    comb [T, 4, 4]."""
    from engine.ops.reference import expand_in_order
    out = expand_in_order(y.float(), residual.float(), post.float(), comb.float())
    return out.bfloat16() if bf16_out else out


@triton.jit
def _expand_kernel(y_ptr, r_ptr, post_ptr, comb_ptr, out_ptr, DIM: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    m = d < DIM
    yv = tl.load(y_ptr + t * DIM + d, mask=m, other=0.0).to(tl.float32)
    x0 = tl.load(r_ptr + (t * 4) * DIM + d, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(r_ptr + (t * 4 + 1) * DIM + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(r_ptr + (t * 4 + 2) * DIM + d, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(r_ptr + (t * 4 + 3) * DIM + d, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(4):
        c = comb_ptr + t * 16 + j
        v = tl.load(c) * x0 + tl.load(c + 4) * x1  # the reference's order (launched without FMA fusion)
        v = v + tl.load(c + 8) * x2
        v = v + tl.load(c + 12) * x3
        v = v + tl.load(post_ptr + t * 4 + j) * yv
        tl.store(out_ptr + (t * 4 + j) * DIM + d, cast_rne(v, tl.bfloat16).to(out_ptr.dtype.element_ty), mask=m)


def mhc_expand_triton(y, residual, post, comb, block_d: int = 1024, bf16_out: bool = False):
    """mhc_expand_reference in one launch: one read of y and the 4 copies, one write of the 4 new ones,
    bit for bit the reference's float32 operations (no FMA contraction: `enable_fp_fusion=False`). A bf16 y or
    residual is read as it is, and bf16_out stores the new copies bf16 (their values are bf16 already)."""
    t, hc, dim = residual.shape
    if hc != 4 or tuple(y.shape) != (t, dim) or tuple(post.shape) != (t, 4) or tuple(comb.shape) != (t, 4, 4):
        raise ValueError(f"expand: residual [T, 4, dim], y [T, dim], post [T, 4], comb [T, 4, 4]; got "
                         f"{tuple(residual.shape)}, {tuple(y.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}")
    out = torch.empty(t, 4, dim, dtype=torch.bfloat16 if bf16_out else torch.float32, device=residual.device)
    if t:
        bd = min(block_d, triton.next_power_of_2(dim))
        rc = residual if residual.dtype == torch.bfloat16 else residual.float()
        yc = y if y.dtype == torch.bfloat16 else y.float()
        _expand_kernel[(t, triton.cdiv(dim, bd))](yc.contiguous(), rc.contiguous(),
                                                  post.float().contiguous(), comb.float().contiguous(), out,
                                                  DIM=dim, BD=bd, num_warps=4, enable_fp_fusion=False)
    return out
