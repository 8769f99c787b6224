"""Sparse MQA attention over selected FP4 global entries plus the FP8 sliding window, with sinks.

Shapes (release: H = 64 heads, D = 512, one latent per entry, K = V):
  q          bf16 [T, H, D]
  kv_packed  int8 [N, D/2]            kv_scale  float8_e4m3fn [N, D/16]    (global entries, FP4)
  idx        int32 [T, K]             indices into the N global entries, -1 = skip
  win        float8_e4m3fn [W, D]     win_scale float8_e8m0fnu [W, D/32]   (window slots, FP8)
  win_idx    int32 [T, Wn]            indices into the W window slots, -1 = skip
  sink       float32 [H]
out[t, h] = sum_j p_j v_j with p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink_h)), s_j = scale q.k_j,
scale = D^-0.5 by default; bf16 [T, H, D]. A row with nothing selected gives zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import dot_dtype, e4m3_value, e8m0_value, fp4_value


def _check(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink):
    t, h, d = q.shape
    if kv_packed.shape[1] != d // 2 or kv_scale.shape[1] != d // 16 or win.shape[1] != d \
            or win_scale.shape[1] != d // 32:
        raise ValueError("sparse attention: cache widths disagree with the query head dim "
                         f"{d}: kv {tuple(kv_packed.shape)}/{tuple(kv_scale.shape)}, "
                         f"window {tuple(win.shape)}/{tuple(win_scale.shape)}")
    if idx.shape[0] != t or win_idx.shape[0] != t or sink.shape != (h,):
        raise ValueError("sparse attention: idx/win_idx must have T rows and sink H entries")
    return t, h, d


def sparse_attn_reference(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink, scale=None):
    """float64 reference on dequantized caches; returns bf16 [T, H, D] on q's device."""
    t, h, d = _check(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink)
    scale = d ** -0.5 if scale is None else scale
    kv = Q.dequantize_fp4(kv_packed.cpu(), kv_scale.cpu(), 16).double()  # [N, D]
    wv = Q.dequantize_fp8(win.cpu(), win_scale.cpu(), 32).double()  # [W, D]
    ent = torch.cat([kv, wv])  # [N + W, D]
    n = kv.shape[0]
    i_g, i_w = idx.cpu().long(), win_idx.cpu().long()
    all_idx = torch.cat([i_g, torch.where(i_w >= 0, i_w + n, -1)], dim=1)  # [T, K + Wn]
    valid = all_idx >= 0
    e = ent[all_idx.clamp_min(0)]  # [T, K + Wn, D]
    s = torch.einsum("thd,tjd->thj", q.cpu().double(), e) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink.cpu().double()[None, :])  # [T, H]
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink.cpu().double()[None, :] - m)
    out = torch.einsum("thj,tjd->thd", p, e) / den[..., None]
    return out.to(torch.bfloat16).to(q.device)


@triton.jit
def _sparse_attn_kernel(q_ptr, kvp_ptr, kvs_ptr, idx_ptr, win_ptr, wins_ptr, widx_ptr, sink_ptr, out_ptr,
                        n_sel, n_win, qk_scale_log2, H: tl.constexpr, D: tl.constexpr,
                        BH: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BH + tl.arange(0, BH)
    dcol = tl.arange(0, D)
    q = tl.load(q_ptr + (t.to(tl.int64) * H + heads[:, None]) * D + dcol[None, :]).to(DT)  # [BH, D]
    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    jh = tl.arange(0, D // 2)
    # global FP4 entries (E4M3 scale per 16 values = per 8 bytes)
    for start in range(0, n_sel, BN):
        offs = start + tl.arange(0, BN)
        ent = tl.load(idx_ptr + t.to(tl.int64) * n_sel + offs, mask=offs < n_sel, other=-1)
        ok = ent >= 0
        row = tl.where(ok, ent, 0).to(tl.int64)
        b = tl.load(kvp_ptr + row[:, None] * (D // 2) + jh[None, :], mask=ok[:, None], other=0).to(tl.int32)
        sc = e4m3_value(tl.load(kvs_ptr + row[:, None] * (D // 16) + jh[None, :] // 8, mask=ok[:, None],
                                other=0).to(tl.int32))
        lo = fp4_value(b & 15) * sc
        hi = fp4_value((b >> 4) & 15) * sc
        kv = tl.join(lo, hi).reshape(BN, D).to(DT)  # [BN, D]
        s = tl.dot(q, tl.trans(kv)) * qk_scale_log2  # [BH, BN], log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), kv)
        m_i = m_new
    # window FP8 entries (E8M0 scale per 32 values)
    for start in range(0, n_win, BN):
        offs = start + tl.arange(0, BN)
        ent = tl.load(widx_ptr + t.to(tl.int64) * n_win + offs, mask=offs < n_win, other=-1)
        ok = ent >= 0
        row = tl.where(ok, ent, 0).to(tl.int64)
        v8 = tl.load(win_ptr + row[:, None] * D + dcol[None, :], mask=ok[:, None], other=0).to(tl.int32)
        sc = e8m0_value(tl.load(wins_ptr + row[:, None] * (D // 32) + dcol[None, :] // 32, mask=ok[:, None],
                                other=127).to(tl.int32))
        kv = (e4m3_value(v8) * sc).to(DT)
        s = tl.dot(q, tl.trans(kv)) * qk_scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), kv)
        m_i = m_new
    sink = tl.load(sink_ptr + heads) * 1.4426950408889634
    l_i += tl.exp2(sink - m_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (t.to(tl.int64) * H + heads[:, None]) * D + dcol[None, :], out.to(tl.bfloat16))


def sparse_attn_triton(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink, scale=None,
                       block_h: int = 16, block_n: int = 32, num_warps: int = 4, num_stages: int = 1):
    t, h, d = _check(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink)
    scale = d ** -0.5 if scale is None else scale
    bh = min(block_h, h)
    if h % bh:
        raise ValueError(f"head count {h} is not a multiple of the head block {bh}")
    out = torch.empty_like(q, dtype=torch.bfloat16)
    _sparse_attn_kernel[(t, h // bh)](
        q.contiguous(), kv_packed.contiguous(), kv_scale.contiguous().view(torch.uint8),
        idx.to(torch.int32).contiguous(), win.contiguous().view(torch.uint8),
        win_scale.contiguous().view(torch.uint8), win_idx.to(torch.int32).contiguous(),
        sink.float().contiguous(), out, idx.shape[1], win_idx.shape[1], scale * math.log2(math.e),
        H=h, D=d, BH=bh, BN=block_n, DT=dot_dtype(), num_warps=num_warps, num_stages=num_stages)
    return out
