"""FP4 weight-only routed-expert MoE: grouped GEMMs over the tokens routed to each expert.

Shapes (release: E = 384 experts, dim = 5120, I = 2304, top-6):
  x             bf16 [T, dim]
  w1, w3        int8 [E, I, dim/2]   w1_scale, w3_scale float8_e8m0fnu [E, I, dim/32]
  w2            int8 [E, dim, I/2]   w2_scale float8_e8m0fnu [E, dim, I/32]
  topk_ids      int32 [T, k]         topk_weights float32 [T, k] (already normalized and scaled)
out[t] = sum_k w[t,k] * W2_e (silu(min(W1_e x, L)) * clamp(W3_e x, -L, L)), e = topk_ids[t,k], L = 10;
float32 [T, dim]. Weights are decoded from FP4 in registers; activations stay bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import dot_dtype, e8m0_value, fp4_value


def _check(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights):
    t, dim = x.shape
    e, inter, half = w1.shape
    if half * 2 != dim or w3.shape != w1.shape or w2.shape != (e, dim, inter // 2):
        raise ValueError(f"MoE weight shapes disagree with x [{t}, {dim}]: w1 {tuple(w1.shape)}, "
                         f"w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}")
    if w1_scale.shape != (e, inter, dim // 32) or w2_scale.shape != (e, dim, inter // 32):
        raise ValueError("MoE scale shapes must be [E, I, dim/32] and [E, dim, I/32]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    return t, dim, e, inter, topk_ids.shape[1]


def moe_fp4_reference(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights,
                      swiglu_limit: float = 10.0):
    """Dequantize each used expert, run it on its tokens (float64 on the CPU, float32 elsewhere)."""
    t, dim, e, inter, k = _check(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights)
    cdt = torch.float64 if x.device.type == "cpu" else torch.float32
    out = torch.zeros(t, dim, dtype=cdt, device=x.device)
    xf = x.to(cdt)
    for ex in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == ex).nonzero(as_tuple=True)
        a = Q.dequantize_fp4(w1[ex], w1_scale[ex], 32).to(cdt)
        b = Q.dequantize_fp4(w3[ex], w3_scale[ex], 32).to(cdt)
        c = Q.dequantize_fp4(w2[ex], w2_scale[ex], 32).to(cdt)
        xe = xf[tok]
        h = F.silu((xe @ a.T).clamp(max=swiglu_limit)) * (xe @ b.T).clamp(-swiglu_limit, swiglu_limit)
        out.index_add_(0, tok, (h @ c.T) * topk_weights[tok, slot].to(cdt)[:, None])
    return out.float()


def _dequantize_fp4_device(packed, scale):
    """Device-side FP4 dequantization for the reference at release shapes (engine.quant's table is CPU)."""
    table = Q.FP4_TABLE.to(packed.device)
    b = packed.view(torch.uint8)
    v = torch.stack([table[(b & 15).long()], table[(b >> 4).long()]], -1).flatten(-2)
    return (v.unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)).flatten(-2)


def moe_align(topk_ids: torch.Tensor, n_experts: int, block_m: int):
    """Group (token, slot) pairs by expert into row blocks of block_m; no host sync (graph-safe).

    Returns order int32 [P] (pair ids sorted by expert), and per block: expert (-1 = unused),
    first and end row in `order`, each int32 [NB] with NB = min(P, ceil(P/block_m) + min(E, P))."""
    flat = topk_ids.flatten().long()
    p = flat.numel()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    # scatter_add, not bincount: bincount reads the max back to the host, which breaks graph capture
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    row_start = torch.cumsum(counts, 0) - counts
    nblk = (counts + block_m - 1) // block_m
    blk_cum = torch.cumsum(nblk, 0)
    nb = min(p, -(-p // block_m) + min(n_experts, p))
    b = torch.arange(nb, device=flat.device)
    e_of_b = torch.searchsorted(blk_cum, b, right=True).clamp(max=n_experts - 1)
    within = b - (blk_cum[e_of_b] - nblk[e_of_b])
    begin = row_start[e_of_b] + within * block_m
    end = torch.minimum(begin + block_m, row_start[e_of_b] + counts[e_of_b])
    used = b < blk_cum[-1]
    expert = torch.where(used, e_of_b, -1).to(torch.int32)
    return order, expert, begin.to(torch.int32), end.to(torch.int32)


@triton.jit
def _fp4_weight_tile(w_ptr, s_ptr, n_idx, n_mask, k0, KDIM: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """[BN, BK] tile of an FP4 (E8M0 per 32) weight [N, KDIM], decoded to DT."""
    j = tl.arange(0, BK // 2)
    b = tl.load(w_ptr + n_idx[:, None].to(tl.int64) * (KDIM // 2) + (k0 // 2 + j)[None, :],
                mask=n_mask[:, None], other=0).to(tl.int32)
    sc = e8m0_value(tl.load(s_ptr + n_idx[:, None].to(tl.int64) * (KDIM // 32) + ((k0 // 2 + j) // 16)[None, :],
                            mask=n_mask[:, None], other=127).to(tl.int32))
    lo = fp4_value(b & 15) * sc
    hi = fp4_value((b >> 4) & 15) * sc
    return tl.join(lo, hi).reshape(b.shape[0], BK).to(DT)


@triton.jit
def _moe_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, h_ptr,
                        limit, DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    mb = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + mb)
    if e < 0:
        return
    r0 = tl.load(bbeg_ptr + mb)
    r1 = tl.load(bend_ptr + mb)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r1
    tok = tl.load(order_ptr + rows, mask=rmask, other=0) // TOPK
    n_idx = nb * BN + tl.arange(0, BN)
    n_mask = n_idx < INTER
    w_off = e.to(tl.int64) * INTER
    acc1 = tl.zeros([BM, BN], tl.float32)
    acc3 = tl.zeros([BM, BN], tl.float32)
    kk = tl.arange(0, BK)
    for k0 in range(0, DIM, BK):
        xt = tl.load(x_ptr + tok[:, None].to(tl.int64) * DIM + (k0 + kk)[None, :], mask=rmask[:, None],
                     other=0.0).to(DT)
        a = _fp4_weight_tile(w1_ptr + w_off * (DIM // 2), s1_ptr + w_off * (DIM // 32), n_idx, n_mask, k0,
                             DIM, BK, DT)
        acc1 += tl.dot(xt, tl.trans(a))
        b = _fp4_weight_tile(w3_ptr + w_off * (DIM // 2), s3_ptr + w_off * (DIM // 32), n_idx, n_mask, k0,
                             DIM, BK, DT)
        acc3 += tl.dot(xt, tl.trans(b))
    g = tl.minimum(acc1, limit)
    u = tl.minimum(tl.maximum(acc3, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + rows[:, None].to(tl.int64) * INTER + n_idx[None, :], h.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w2_ptr, s2_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, tw_ptr, out_ptr,
                     DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    mb = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(bexp_ptr + mb)
    if e < 0:
        return
    r0 = tl.load(bbeg_ptr + mb)
    r1 = tl.load(bend_ptr + mb)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r1
    pair = tl.load(order_ptr + rows, mask=rmask, other=0)
    tok = pair // TOPK
    n_idx = nb * BN + tl.arange(0, BN)
    n_mask = n_idx < DIM
    w_off = e.to(tl.int64) * DIM
    acc = tl.zeros([BM, BN], tl.float32)
    kk = tl.arange(0, BK)
    for k0 in range(0, INTER, BK):
        ht = tl.load(h_ptr + rows[:, None].to(tl.int64) * INTER + (k0 + kk)[None, :], mask=rmask[:, None],
                     other=0.0).to(DT)
        w = _fp4_weight_tile(w2_ptr + w_off * (INTER // 2), s2_ptr + w_off * (INTER // 32), n_idx, n_mask, k0,
                             INTER, BK, DT)
        acc += tl.dot(ht, tl.trans(w))
    tw = tl.load(tw_ptr + pair, mask=rmask, other=0.0)
    tl.atomic_add(out_ptr + tok[:, None].to(tl.int64) * DIM + n_idx[None, :], acc * tw[:, None],
                  mask=rmask[:, None] & n_mask[None, :])


def moe_fp4_triton(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights,
                   swiglu_limit: float = 10.0, block_m: int | None = None, block_n: int | None = None,
                   block_k: int = 64, num_warps: int = 4, num_stages: int = 3):
    t, dim, e, inter, k = _check(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights)
    p = t * k
    if block_m is None:
        block_m = 16 if p <= 4 * e else 64
    if block_n is None:
        block_n = 32 if block_m == 16 else 128
    if block_m == 16 and block_k == 64:
        block_k = 256  # decode streams weights: longer rows per load
    bk = min(block_k, inter, dim)
    if dim % bk or inter % bk or bk % 32:
        raise ValueError(f"dim {dim} and I {inter} must be multiples of the K block {bk} (a multiple of 32)")
    order, bexp, bbeg, bend = moe_align(topk_ids, e, block_m)
    dt = dot_dtype()
    h = torch.empty(p, inter, dtype=torch.bfloat16 if dt == tl.bfloat16 else torch.float32, device=x.device)
    out = torch.zeros(t, dim, dtype=torch.float32, device=x.device)
    nb = bexp.numel()
    u8 = torch.uint8
    _moe_gate_up_kernel[(nb, triton.cdiv(inter, block_n))](
        x.contiguous(), w1, w1_scale.view(u8), w3, w3_scale.view(u8), order, bexp, bbeg, bend, h,
        float(swiglu_limit), DIM=dim, INTER=inter, TOPK=k, BM=block_m, BN=block_n, BK=bk, DT=dt,
        num_warps=num_warps, num_stages=num_stages)
    _moe_down_kernel[(nb, triton.cdiv(dim, block_n))](
        h, w2, w2_scale.view(u8), order, bexp, bbeg, bend, topk_weights.float().contiguous(), out,
        DIM=dim, INTER=inter, TOPK=k, BM=block_m, BN=block_n, BK=bk, DT=dt,
        num_warps=num_warps, num_stages=num_stages)
    return out
