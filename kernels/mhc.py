"""Fused single-pass mHC (manifold-constrained hyper-connections, 4 copies of the stream).

One launch does, per token, in one read of the stream:
  [optional post/comb update]  Xn[j] = post_old[j] * y + sum_i comb_old[i, j] * X[i]   (stored, X's dtype)
  collapse                     x = sum_c pre_prev[c] * Xn[c]                           (X's dtype)
  mixes                        m = (flatten(Xn) @ fn^T) * rsqrt(mean(Xn^2) + norm_eps)   (24 values)
  pre = sigmoid(m[0:4] s0 + b) + hc_eps;  post = 2 sigmoid(m[4:8] s1 + b)
  comb = softmax_rows(m[8:24] s2 + b) + hc_eps, columns / (sum + hc_eps), then 19 rounds rows-then-columns.
Shapes: X [T, 4, dim], fn float32 [24, 4*dim], scale [3], base [24], pre_prev [T, 4], y [T, dim],
post_old [T, 4], comb_old [T, 4, 4]. Returns (Xn or None, x [T, dim], pre [T, 4], post [T, 4], comb [T, 4, 4]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
                  norm_eps=1e-20, hc_eps=1e-6, iters=20):
    t, dim = _check(x, fn, scale, base, pre_prev, y, post_old, comb_old)
    cdt = torch.float64 if x.device.type == "cpu" else torch.float32
    xs = x.to(cdt)
    xn = None
    if y is not None:
        xs = post_old.to(cdt)[..., None] * y.to(cdt)[:, None, :] \
            + torch.einsum("tij,tid->tjd", comb_old.to(cdt), xs)
        xn = xs.to(x.dtype)
        xs = xn.to(cdt)
    collapse = torch.einsum("tc,tcd->td", pre_prev.to(cdt), xs).to(x.dtype)
    flat = xs.flatten(1)
    m = (flat @ fn.to(cdt).T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre, post, comb = sinkhorn_split_reference(m, scale.to(cdt), base.to(cdt), hc_eps, iters)
    return xn, collapse, pre.float(), post.float(), comb.float()


@triton.jit
def _mhc_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, prep_ptr, y_ptr, posto_ptr, combo_ptr,
                xn_ptr, xc_ptr, pre_ptr, post_ptr, comb_ptr, T, norm_eps, hc_eps,
                DIM: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ITERS: tl.constexpr,
                HAS_POST: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    tm = t < T
    t64 = t.to(tl.int64)
    q0 = tl.load(prep_ptr + t * 4 + 0, mask=tm, other=0.0)
    q1 = tl.load(prep_ptr + t * 4 + 1, mask=tm, other=0.0)
    q2 = tl.load(prep_ptr + t * 4 + 2, mask=tm, other=0.0)
    q3 = tl.load(prep_ptr + t * 4 + 3, mask=tm, other=0.0)
    r16 = tl.arange(0, 16)
    acc_a = tl.zeros([BT, 16], tl.float32)  # mixes 0..7 (pre, post), 8 padding columns
    acc_c = tl.zeros([BT, 16], tl.float32)  # mixes 8..23 (comb)
    sumsq = tl.zeros([BT], tl.float32)
    for d0 in range(0, DIM, BD):
        d = d0 + tl.arange(0, BD)
        xoff = t64[:, None] * (4 * DIM) + d[None, :]
        m2 = tm[:, None]
        x0 = tl.load(x_ptr + xoff, mask=m2, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + xoff + DIM, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xoff + 2 * DIM, mask=m2, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + xoff + 3 * DIM, mask=m2, other=0.0).to(tl.float32)
        if HAS_POST:
            yv = tl.load(y_ptr + t64[:, None] * DIM + d[None, :], mask=m2, other=0.0).to(tl.float32)
            n0 = tl.load(posto_ptr + t * 4 + 0, mask=tm, other=0.0)[:, None] * yv
            n1 = tl.load(posto_ptr + t * 4 + 1, mask=tm, other=0.0)[:, None] * yv
            n2 = tl.load(posto_ptr + t * 4 + 2, mask=tm, other=0.0)[:, None] * yv
            n3 = tl.load(posto_ptr + t * 4 + 3, mask=tm, other=0.0)[:, None] * yv
            for i in tl.static_range(4):
                if i == 0:
                    xi = x0
                elif i == 1:
                    xi = x1
                elif i == 2:
                    xi = x2
                else:
                    xi = x3
                n0 += tl.load(combo_ptr + t * 16 + i * 4 + 0, mask=tm, other=0.0)[:, None] * xi
                n1 += tl.load(combo_ptr + t * 16 + i * 4 + 1, mask=tm, other=0.0)[:, None] * xi
                n2 += tl.load(combo_ptr + t * 16 + i * 4 + 2, mask=tm, other=0.0)[:, None] * xi
                n3 += tl.load(combo_ptr + t * 16 + i * 4 + 3, mask=tm, other=0.0)[:, None] * xi
            # round to the stream's dtype first: the mixes and the collapse see the stored stream
            x0 = n0.to(xn_ptr.dtype.element_ty)
            x1 = n1.to(xn_ptr.dtype.element_ty)
            x2 = n2.to(xn_ptr.dtype.element_ty)
            x3 = n3.to(xn_ptr.dtype.element_ty)
            tl.store(xn_ptr + xoff, x0, mask=m2)
            tl.store(xn_ptr + xoff + DIM, x1, mask=m2)
            tl.store(xn_ptr + xoff + 2 * DIM, x2, mask=m2)
            tl.store(xn_ptr + xoff + 3 * DIM, x3, mask=m2)
            x0 = x0.to(tl.float32)
            x1 = x1.to(tl.float32)
            x2 = x2.to(tl.float32)
            x3 = x3.to(tl.float32)
        sumsq += tl.sum(x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3, axis=1)
        col = q0[:, None] * x0 + q1[:, None] * x1 + q2[:, None] * x2 + q3[:, None] * x3
        tl.store(xc_ptr + t64[:, None] * DIM + d[None, :], col.to(xc_ptr.dtype.element_ty), mask=m2)
        for c in tl.static_range(4):
            if c == 0:
                xc = x0
            elif c == 1:
                xc = x1
            elif c == 2:
                xc = x2
            else:
                xc = x3
            # [16, BD] tiles, contiguous along d (coalesced); transposed for the dot
            fa = tl.load(fn_ptr + r16[:, None] * (4 * DIM) + c * DIM + d[None, :], mask=r16[:, None] < 8,
                         other=0.0)
            fc = tl.load(fn_ptr + (8 + r16[:, None]) * (4 * DIM) + c * DIM + d[None, :])
            acc_a += tl.dot(xc, tl.trans(fa), input_precision=PREC)
            acc_c += tl.dot(xc, tl.trans(fc), input_precision=PREC)
    rs = 1.0 / tl.sqrt(sumsq / (4 * DIM) + norm_eps)
    s0 = tl.load(scale_ptr + 0)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    ma = tl.reshape(acc_a * rs[:, None], (BT, 4, 4))  # row 0: pre, row 1: post
    r4 = tl.arange(0, 4)
    b_pre = tl.load(base_ptr + r4)
    b_post = tl.load(base_ptr + 4 + r4)
    m_pre = tl.sum(tl.where(r4[None, :, None] == 0, ma, 0.0), axis=1)  # [BT, 4]
    m_post = tl.sum(tl.where(r4[None, :, None] == 1, ma, 0.0), axis=1)
    pre = 1.0 / (1.0 + tl.exp(-(m_pre * s0 + b_pre[None, :]))) + hc_eps
    post = 2.0 / (1.0 + tl.exp(-(m_post * s1 + b_post[None, :])))
    b_comb = tl.load(base_ptr + 8 + r4[:, None] * 4 + r4[None, :])  # [4, 4]
    z = tl.reshape(acc_c * rs[:, None], (BT, 4, 4)) * s2 + b_comb[None, :, :]
    z = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    cm = z / tl.sum(z, axis=2)[:, :, None] + hc_eps
    cm = cm / (tl.sum(cm, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        cm = cm / (tl.sum(cm, axis=2)[:, :, None] + hc_eps)
        cm = cm / (tl.sum(cm, axis=1)[:, None, :] + hc_eps)
    o4 = t[:, None] * 4 + r4[None, :]
    tl.store(pre_ptr + o4, pre, mask=tm[:, None])
    tl.store(post_ptr + o4, post, mask=tm[:, None])
    o16 = t[:, None, None] * 16 + r4[None, :, None] * 4 + r4[None, None, :]
    tl.store(comb_ptr + o16, cm, mask=tm[:, None, None])


def mhc_triton(x, fn, scale, base, pre_prev, y=None, post_old=None, comb_old=None,
               norm_eps=1e-20, hc_eps=1e-6, iters=20, block_t: int = 16, block_d: int = 128,
               precision: str = "tf32x3", num_warps: int = 4):
    t, dim = _check(x, fn, scale, base, pre_prev, y, post_old, comb_old)
    bd = min(block_d, dim)
    if dim % bd:
        raise ValueError(f"dim {dim} must be a multiple of the d block {bd}")
    dev = x.device
    xc = torch.empty(t, dim, dtype=x.dtype, device=dev)
    xn = torch.empty_like(x) if y is not None else None
    pre = torch.empty(t, 4, dtype=torch.float32, device=dev)
    post = torch.empty(t, 4, dtype=torch.float32, device=dev)
    comb = torch.empty(t, 4, 4, dtype=torch.float32, device=dev)
    f32 = lambda v: v.float().contiguous()
    _mhc_kernel[(triton.cdiv(t, block_t),)](
        x.contiguous(), f32(fn), f32(scale), f32(base), f32(pre_prev),
        y.contiguous() if y is not None else x, f32(post_old) if y is not None else pre,
        f32(comb_old) if y is not None else comb, xn if xn is not None else xc, xc, pre, post, comb,
        t, float(norm_eps), float(hc_eps), DIM=dim, BT=block_t, BD=bd, ITERS=iters,
        HAS_POST=y is not None, PREC=precision, num_warps=num_warps)
    return xn, xc, pre, post, comb
