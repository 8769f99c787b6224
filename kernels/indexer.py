"""Lightning indexer: FP4 queries x FP4 keys -> weighted ReLU head sum -> masked top-k positions.

Shapes (release: H = 32 heads, D = 128, groups of 32 with E8M0 scales, top-k 512):
  q_packed  int8 [T, H, D/2]      q_scale  float8_e8m0fnu [T, H, D/32]
  k_packed  int8 [N, D/2]         k_scale  float8_e8m0fnu [N, D/32]
  weights   float32 [T, H]        (already times D^-0.5 * H^-0.5)
  n_visible int32 [T]             entry j is visible to query t iff j < n_visible[t]
  pool_mask bool [T, ceil(N/pool_block)] or None: entry j allowed iff pool_mask[t, j // pool_block]
score[t, j] = sum_h w[t,h] * relu(q[t,h] . k[j]); masked entries are -inf.
`indexer_topk_*` returns int32 [T, k]: positions of the top min(k, allowed) scores, ascending, -1 padded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import dot_dtype, e8m0_value, fp4_value
from kernels.topk import topk_positions_reference, topk_positions_triton


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


@triton.jit
def _decode_fp4_tile(p_ptr, s_ptr, rows, row_mask, HALF: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
    """Rows of packed FP4 (E8M0 per 32) -> DT [R, D] (bf16 is exact for these values)."""
    j = tl.arange(0, HALF)
    b = tl.load(p_ptr + rows[:, None] * HALF + j[None, :], mask=row_mask[:, None], other=0).to(tl.int32)
    sc = e8m0_value(tl.load(s_ptr + rows[:, None] * (D // 32) + (j[None, :] // 16),
                            mask=row_mask[:, None], other=127).to(tl.int32))
    lo = fp4_value(b & 15) * sc
    hi = fp4_value((b >> 4) & 15) * sc
    return tl.join(lo, hi).reshape(lo.shape[0], D).to(DT)


@triton.jit
def _indexer_scores_kernel(qp_ptr, qs_ptr, kp_ptr, ks_ptr, w_ptr, nvis_ptr, pool_ptr, out_ptr,
                           T, N, n_pool_cols, stride_out, POOL_BLOCK: tl.constexpr,
                           H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                           HAS_POOL: tl.constexpr, DT: tl.constexpr, NLOOP: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    t_mask = t < T
    n_vis = tl.load(nvis_ptr + t, mask=t_mask, other=0)
    qrows = t[:, None] * H + tl.arange(0, H)[None, :]  # [BT, H]
    qrows = tl.reshape(qrows, (BT * H,))
    qrow_mask = qrows < T * H
    q = _decode_fp4_tile(qp_ptr, qs_ptr, qrows, qrow_mask, D // 2, D, DT)  # [BT*H, D], reused NLOOP times
    w = tl.load(w_ptr + qrows, mask=qrow_mask, other=0.0)
    for it in range(NLOOP):
        _indexer_scores_tile(q, w, kp_ptr, ks_ptr, pool_ptr, out_ptr, t, t_mask, n_vis, (pid_n * NLOOP + it) * BN,
                             N, n_pool_cols, stride_out, POOL_BLOCK, H, D, BT, BN, HAS_POOL, DT)


@triton.jit
def _indexer_scores_tile(q, w, kp_ptr, ks_ptr, pool_ptr, out_ptr, t, t_mask, n_vis, n0, N, n_pool_cols, stride_out,
                         POOL_BLOCK: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                         BN: tl.constexpr, HAS_POOL: tl.constexpr, DT: tl.constexpr):
    cols = n0 + tl.arange(0, BN)
    out_ptrs = out_ptr + t[:, None].to(tl.int64) * stride_out + cols[None, :]
    store_mask = t_mask[:, None] & (cols[None, :] < N)
    if n0 >= tl.max(n_vis, axis=0):  # nothing visible to any query of this tile: skip the keys
        tl.store(out_ptrs, tl.full([BT, BN], float("-inf"), tl.float32), mask=store_mask)
    else:
        kmask = cols < N
        k = _decode_fp4_tile(kp_ptr, ks_ptr, cols, kmask, D // 2, D, DT)  # [BN, D]
        s = tl.dot(q, tl.trans(k))  # [BT*H, BN], exact products, fp32 sums
        s = tl.maximum(s, 0.0) * w[:, None]
        score = tl.sum(tl.reshape(s, (BT, H, BN)), axis=1)  # [BT, BN]
        allowed = cols[None, :] < n_vis[:, None]
        if HAS_POOL:
            pm = tl.load(pool_ptr + t[:, None] * n_pool_cols + cols[None, :] // POOL_BLOCK,
                         mask=store_mask, other=0)
            allowed &= pm != 0
        tl.store(out_ptrs, tl.where(allowed, score, float("-inf")), mask=store_mask)


def indexer_scores_triton(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                          pool_mask=None, pool_block: int = 8) -> torch.Tensor:
    t, h, d, n = _check(q_packed, q_scale, k_packed, k_scale, weights, n_visible, pool_mask, pool_block)
    out = torch.empty(t, n, dtype=torch.float32, device=q_packed.device)
    bt = 1 if t < 16 else max(1, 128 // h)
    bn = 128
    nloop = 1 if t < 16 else 4
    pool = pool_mask.contiguous().view(torch.uint8) if pool_mask is not None else out
    _indexer_scores_kernel[(triton.cdiv(t, bt), triton.cdiv(n, bn * nloop))](
        q_packed.contiguous(), q_scale.contiguous().view(torch.uint8), k_packed.contiguous(),
        k_scale.contiguous().view(torch.uint8), weights.float().contiguous(),
        n_visible.to(torch.int32).contiguous(), pool, out, t, n,
        pool_mask.shape[1] if pool_mask is not None else 0, out.stride(0), POOL_BLOCK=pool_block,
        H=h, D=d, BT=bt, BN=bn, HAS_POOL=pool_mask is not None, DT=dot_dtype(), NLOOP=nloop, num_warps=4)
    return out


def indexer_topk_triton(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                        pool_mask=None, topk: int = 512, pool_block: int = 8) -> torch.Tensor:
    """Scores in one launch (keys read once per query tile), then the radix top-k (see kernels.topk)."""
    scores = indexer_scores_triton(q_packed, q_scale, k_packed, k_scale, weights, n_visible,
                                   pool_mask, pool_block)
    return topk_positions_triton(scores, topk, n_visible)
