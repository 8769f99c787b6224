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

Triton design (sm_90): one program per (token, head block of 64 = one warpgroup MMA's M, split,
output half when d_split = 2), one loop over BN-entry tiles (selected FP4 first, then FP8 window).
Raw bytes of tile i+1 (and indices of i+2) are loaded before tile i is decoded. Decoding places the
FP4/E4M3 bits straight into float32 (no table, no branches), 4 values per int lane, joined in-thread
into natural dim order; entries are kept at 1/256 of their value so the FP4 multiplier scale * 2^118
stays finite. Decode (few programs per token) splits the entries over programs writing (acc, max, sum)
partials; _merge_kernel adds the sink. d_split = 2 halves the [BH, D] fp32 accumulator (128 -> 64
registers per thread at 8 warps); each half-program still computes all of S.
ptxas for sm_90 (8 warps, BH 64, spill bytes, triton 3.6 / 3.7): prefill BN 16: 428 / 68, BN 32:
724 / 328; d_split 2: BN 16: 84 / 0, BN 32: 432 / 0. The non-accumulator working set (raw tile and its
prefetch with one scale byte per lane, both formats' loads, f32 decode temporaries) is what still
spills on 3.6: quartering D into four accumulators or two per-format loops made it worse (tried).

layout="entries" (_sparse_attn_t_kernel): the dots transposed, entries as the MMA's M (S^T = K Q^T, then
O^T += V^T P^T), so the warpgroups split the tile's entries instead of sharing the heads' S. Triton
(3.6/3.7) moves a dot's A operand into registers when it is computed in the loop (the decoded tile:
the whole tile per warpgroup); carried as a loop value it stays in shared memory for both dots, so the
tile is decoded one iteration ahead.

layout="two_pass" (kernels/sparse_attn_decode.py): scores for all heads in one launch, the weighted sum over
column blocks in a second; in its bf16x2 form the wrapper's default for prefills and decode batches of 16+
tokens since H200 run 24a (sparse_attn_triton's docstring).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import bf16_output, dot_dtype, sm_count


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


def sparse_attn_reference(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink, scale=None,
                          float_out: bool = False):
    """float64 reference on dequantized caches; returns bf16 [T, H, D] on q's device (float_out: those
    values as float32)."""
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
    out = out.to(torch.bfloat16).to(q.device)
    return out.float() if float_out else out



# Decoded entries are kept at 2^-8 of their value (kv' = kv / 256): the FP4 multiplier scale * 2^118 then
# stays finite for every E4M3 scale; S and the output take the 256 back as constants.
_FOLD = 256.0


def qk_log2(scale: float) -> float:
    """The factor that turns q . kv' into the softmax logit in log2 units (the kernels' exp2)."""
    return scale * math.log2(math.e) * _FOLD


@triton.jit
def _fp4_lane(x, k: tl.constexpr):
    """Nibble k (dim 4j + k) of each int16 group (sign-extended in int32 lanes) -> float32 whose value
    is the E2M1 value * 2^-126: the three magnitude bits land on exponent bits 0-1 and the top mantissa
    bit (codes 0/1 become the subnormals 0 and 2^-127), the sign bit on bit 31."""
    mag = (x << (22 - 4 * k)) & 0x01C00000
    sgn = (x << (28 - 4 * k)) & -2147483648
    return (mag | sgn).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_lane(x, k: tl.constexpr):
    """Byte k (dim 4j + k) of each int32 word -> its E4M3 value (native conversion), float32."""
    return ((x >> (8 * k)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _join4(v0, v1, v2, v3, BN: tl.constexpr, D: tl.constexpr):
    # joins add in-thread axes only: [BN, D/4, 2, 2] flattens to dim 4j + 2a + b
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BN, D))


@triton.jit
def _raw_tile(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, is_win, D: tl.constexpr):
    """Raw bytes of the entries `ent` ([BN], -1 = none) as int32 lanes [BN, D/4] of 4 values each (FP4:
    int16 groups; window: E4M3 words) and one scale byte per lane (FP4: E4M3 per 16 values; window:
    E8M0 per 32). Both loads are issued, one fully masked (no branch: layouts stay unified)."""
    ok = ent >= 0
    row = tl.where(ok, ent, 0).to(tl.int64)
    jw = tl.arange(0, D // 4)
    okw = (ok & (is_win != 0))[:, None]
    okf = (ok & (is_win == 0))[:, None]
    x = tl.load(winw_ptr + row[:, None] * (D // 4) + jw[None, :], mask=okw, other=0) \
        | tl.load(kvh_ptr + row[:, None] * (D // 4) + jw[None, :], mask=okf, other=0).to(tl.int32)
    s = tl.load(wins_ptr + row[:, None] * (D // 32) + jw[None, :] // 8, mask=okw, other=0) \
        | tl.load(kvs_ptr + row[:, None] * (D // 16) + jw[None, :] // 4, mask=okf, other=0)
    return x, s


@triton.jit
def _fp4_decode(x, s, BN: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
    """FP4 lanes + E4M3 scale bytes -> kv' = kv / 256 [BN, D], natural dim order, DT."""
    m = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e+35  # scale * 2^118
    return _join4((_fp4_lane(x, 0) * m).to(DT), (_fp4_lane(x, 1) * m).to(DT), (_fp4_lane(x, 2) * m).to(DT),
                  (_fp4_lane(x, 3) * m).to(DT), BN, D)


@triton.jit
def _win_decode(x, s, BN: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
    """E4M3 words + E8M0 bytes -> kv' = kv / 256 [BN, D], natural order, DT (scales below 2^-118 are
    taken as 2^-118)."""
    m = ((tl.maximum(s.to(tl.int32), 9) - 8) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) / 256
    return _join4((_e4m3_lane(x, 0) * m).to(DT), (_e4m3_lane(x, 1) * m).to(DT), (_e4m3_lane(x, 2) * m).to(DT),
                  (_e4m3_lane(x, 3) * m).to(DT), BN, D)


@triton.jit
def _raw_tile_g(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, is_win, D: tl.constexpr):
    """_raw_tile with the lanes grouped by scale: int32 lanes [BN, D/16, 4] (lane 4g + l holds dims
    16g + 4l .. +3) and one scale byte per group of 16 dims [BN, D/16] (the window's E8M0 byte, one per
    32, read for both of its groups): a quarter of _raw_tile's per-lane scale registers. One format's
    loads are issued (a branch), so only one set of destination registers is live."""
    ok = ent >= 0
    row = tl.where(ok, ent, 0)  # int32 offsets (the wrapper checks N * D / 4 < 2^31): fewer registers
    g = tl.arange(0, D // 16)
    jw = g[:, None] * 4 + tl.arange(0, 4)[None, :]  # [D/16, 4] lane index
    r3 = row[:, None, None] * (D // 4) + jw[None, :, :]
    if is_win:
        x = tl.load(winw_ptr + r3, mask=ok[:, None, None], other=0)
        s = tl.load(wins_ptr + row[:, None] * (D // 32) + g[None, :] // 2, mask=ok[:, None], other=0)
    else:
        x = tl.load(kvh_ptr + r3, mask=ok[:, None, None], other=0).to(tl.int32)
        s = tl.load(kvs_ptr + row[:, None] * (D // 16) + g[None, :], mask=ok[:, None], other=0)
    return x, s


@triton.jit
def _join4g(v0, v1, v2, v3, BN: tl.constexpr, D: tl.constexpr):
    # [BN, D/16, 4, 2, 2] flattens to dim 16g + 4l + 2a + b
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BN, D))


@triton.jit
def _fp4_decode_g(x, s, BN: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
    """_fp4_decode on grouped lanes ([BN, D/16, 4] + [BN, D/16] scales) -> kv' [BN, D], DT."""
    m = (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e+35)[:, :, None]
    return _join4g((_fp4_lane(x, 0) * m).to(DT), (_fp4_lane(x, 1) * m).to(DT), (_fp4_lane(x, 2) * m).to(DT),
                   (_fp4_lane(x, 3) * m).to(DT), BN, D)


@triton.jit
def _win_decode_g(x, s, BN: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
    """_win_decode on grouped lanes -> kv' [BN, D], DT."""
    m = (((tl.maximum(s.to(tl.int32), 9) - 8) << 23).to(tl.float32, bitcast=True))[:, :, None]
    return _join4g((_e4m3_lane(x, 0) * m).to(DT), (_e4m3_lane(x, 1) * m).to(DT), (_e4m3_lane(x, 2) * m).to(DT),
                   (_e4m3_lane(x, 3) * m).to(DT), BN, D)


@triton.jit
def _sink_scale(sink_ptr, heads, m_i, l_i):
    """Per head, the factor that turns the accumulator (kv' units, 1/256) into the output: the sink's
    exp2-unit logit joins the running max and the denominator."""
    sink = tl.load(sink_ptr + heads) * 1.4426950408889634
    mm = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - mm)
    return alpha * 256.0 / (l_i * alpha + tl.exp2(sink - mm))


@triton.jit
def _split_tiles(sp, sel_per_split, n_sel, win_per_split, n_win, BN: tl.constexpr):
    """Split sp's share of a query's entries: its selected range [lo_s, hi_s) and window range
    [lo_w, hi_w), the tiles of BN over the selected part (n_st) and over both (n_t)."""
    lo_s = sp * sel_per_split
    hi_s = tl.minimum(lo_s + sel_per_split, n_sel)
    lo_w = sp * win_per_split
    hi_w = tl.minimum(lo_w + win_per_split, n_win)
    n_st = tl.cdiv(tl.maximum(hi_s - lo_s, 0), BN)
    return lo_s, hi_s, lo_w, hi_w, n_st, n_st + tl.cdiv(tl.maximum(hi_w - lo_w, 0), BN)


@triton.jit
def _tile_ent(idx_row, widx_row, i, n_st, lo_s, hi_s, lo_w, hi_w, ar, BN: tl.constexpr):
    """Entry indices [BN] of this program's tile i: selected tiles first, then window tiles; -1 past
    the end."""
    sel = i < n_st
    start = tl.where(sel, lo_s + i * BN, lo_w + (i - n_st) * BN)
    end = tl.where(sel, hi_s, hi_w)
    base = tl.where(sel, idx_row, widx_row)
    return tl.load(base + start + ar, mask=start + ar < end, other=-1)


@triton.jit
def _sparse_attn_kernel(q_ptr, kvh_ptr, kvs_ptr, idx_ptr, winw_ptr, wins_ptr, widx_ptr, sink_ptr, out_ptr,
                        po_ptr, pm_ptr, pl_ptr, T, n_sel, n_win, sel_per_split, win_per_split, qk2,
                        H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                        DT: tl.constexpr, SPLIT: tl.constexpr, DV: tl.constexpr):
    """One program: token t, heads [hb*BH, +BH), split sp's share of the selected and of the window
    entries, as one loop over tiles (selected first). The next tile's raw bytes (and the indices of the
    one after) are loaded before the current tile is decoded, so the gathers overlap the dots.
    SPLIT: write (acc, max, sum) partials for _merge_kernel; else the output with the sink."""
    t = tl.program_id(0)
    sp = tl.program_id(1)
    hb = tl.program_id(2) // (D // DV)
    dh = tl.program_id(2) % (D // DV)  # which DV-wide slice of the output this program writes
    heads = hb * BH + tl.arange(0, BH)
    dcol = tl.arange(0, D)
    vcol = dh * DV + tl.arange(0, DV)
    ar = tl.arange(0, BN)
    q = tl.load(q_ptr + (t.to(tl.int64) * H + heads[:, None]) * D + dcol[None, :]).to(DT)  # [BH, D]
    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DV], tl.float32)  # kv' units (1/256)

    lo_s, hi_s, lo_w, hi_w, n_st, n_t = _split_tiles(sp, sel_per_split, n_sel, win_per_split, n_win, BN)
    idx_row = idx_ptr + t.to(tl.int64) * n_sel
    widx_row = widx_ptr + t.to(tl.int64) * n_win
    e1 = _tile_ent(idx_row, widx_row, 0, n_st, lo_s, hi_s, lo_w, hi_w, ar, BN)
    e2 = _tile_ent(idx_row, widx_row, 1, n_st, lo_s, hi_s, lo_w, hi_w, ar, BN)
    x1, s1 = _raw_tile(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, e1, n_st <= 0, D)
    for i in range(0, n_t):
        ec, xc, sc = e1, x1, s1
        e1 = e2
        e2 = _tile_ent(idx_row, widx_row, i + 2, n_st, lo_s, hi_s, lo_w, hi_w, ar, BN)
        x1, s1 = _raw_tile(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, e1, i + 1 >= n_st, D)
        if i < n_st:
            kv = _fp4_decode(xc, sc, BN, D, DT)
        else:
            kv = _win_decode(xc, sc, BN, D, DT)
        s = tl.dot(q, tl.trans(kv)) * qk2  # [BH, BN], log2 units
        s = tl.where((ec >= 0)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DV == D:
            kv_v = kv
        else:  # the column halves are in-thread register bits of the decoded layout: a free split
            k_lo, k_hi = tl.split(tl.permute(tl.reshape(kv, (BN, 2, DV)), (0, 2, 1)))
            if dh == 0:
                kv_v = k_lo
            else:
                kv_v = k_hi
        acc = tl.dot(p.to(DT), kv_v, acc * alpha[:, None])
        m_i = m_new

    if SPLIT:
        row = (sp * T + t).to(tl.int64) * H + heads  # [BH] rows of the [S, T, H] partials
        tl.store(po_ptr + row[:, None] * D + vcol[None, :], acc)
        tl.store(pm_ptr + row, m_i)
        tl.store(pl_ptr + row, l_i)
    else:
        out = acc * _sink_scale(sink_ptr, heads, m_i, l_i)[:, None]
        tl.store(out_ptr + (t.to(tl.int64) * H + heads[:, None]) * D + vcol[None, :], bf16_output(out, out_ptr))


@triton.jit
def _sparse_attn_t_kernel(q_ptr, kvh_ptr, kvs_ptr, idx_ptr, winw_ptr, wins_ptr, widx_ptr, sink_ptr, out_ptr,
                          po_ptr, pm_ptr, pl_ptr, T, n_sel, n_win, sel_per_split, win_per_split, qk2,
                          H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                          DT: tl.constexpr, SPLIT: tl.constexpr, DV: tl.constexpr):
    """Entries-as-M layout: the same work as _sparse_attn_kernel with every dot transposed.
    S^T [BN entries, BH heads] = K_tile [BN, D] . Q^T [D, BH] (BN = the MMA's M, shared over the warpgroups,
    so no warpgroup repeats another's S; heads are N), the softmax runs down the columns (axis 0), and
    O^T [DV, BH] += V^T [DV, BN] . P^T [BN, BH] (output columns on M). Grid and partials as there."""
    t = tl.program_id(0)
    sp = tl.program_id(1)
    hb = tl.program_id(2) // (D // DV)
    dh = tl.program_id(2) % (D // DV)
    heads = hb * BH + tl.arange(0, BH)
    dcol = tl.arange(0, D)
    vcol = dh * DV + tl.arange(0, DV)
    ar = tl.arange(0, BN)
    q_t = tl.load(q_ptr + (t.to(tl.int64) * H + heads[None, :]) * D + dcol[:, None]).to(DT)  # [D, BH]
    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([DV, BH], tl.float32)  # O^T, kv' units (1/256)

    lo_s, hi_s, lo_w, hi_w, n_st, n_t = _split_tiles(sp, sel_per_split, n_sel, win_per_split, n_win, BN)
    idx_row = idx_ptr + t.to(tl.int64) * n_sel
    widx_row = widx_ptr + t.to(tl.int64) * n_win
    e1 = _tile_ent(idx_row, widx_row, 0, n_st, lo_s, hi_s, lo_w, hi_w, ar, BN)
    x1, s1 = _raw_tile_g(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, e1, n_st <= 0, D)
    if n_st > 0:
        kv1 = _fp4_decode_g(x1, s1, BN, D, DT)
    else:
        kv1 = _win_decode_g(x1, s1, BN, D, DT)
    e2 = _tile_ent(idx_row, widx_row, 1, n_st, lo_s, hi_s, lo_w, hi_w, ar, BN)
    for i in range(0, n_t):
        # tile i was decoded in the previous iteration and is carried: a loop-carried dot operand goes
        # to shared memory as the MMA's A (a freshly computed one is moved into registers, the whole
        # tile per warpgroup); tile i+1's bytes are loaded here and decoded after tile i's dots
        ec, kv = e1, kv1
        e1 = e2
        e2 = _tile_ent(idx_row, widx_row, i + 2, n_st, lo_s, hi_s, lo_w, hi_w, ar, BN)
        xn, sn = _raw_tile_g(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, e1, i + 1 >= n_st, D)
        s = tl.dot(kv, q_t) * qk2  # S^T [BN, BH], log2 units
        s = tl.where((ec >= 0)[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if DV == D:
            kv_v = kv
        else:
            k_lo, k_hi = tl.split(tl.permute(tl.reshape(kv, (BN, 2, DV)), (0, 2, 1)))
            if dh == 0:
                kv_v = k_lo
            else:
                kv_v = k_hi
        acc = tl.dot(tl.trans(kv_v), p.to(DT), acc * alpha[None, :])
        m_i = m_new
        if i + 1 < n_st:
            kv1 = _fp4_decode_g(xn, sn, BN, D, DT)
        else:
            kv1 = _win_decode_g(xn, sn, BN, D, DT)

    if SPLIT:
        row = (sp * T + t).to(tl.int64) * H + heads  # [BH] rows of the [S, T, H] partials
        tl.store(po_ptr + row[None, :] * D + vcol[:, None], acc)
        tl.store(pm_ptr + row, m_i)
        tl.store(pl_ptr + row, l_i)
    else:
        out = acc * _sink_scale(sink_ptr, heads, m_i, l_i)[None, :]
        tl.store(out_ptr + (t.to(tl.int64) * H + heads[None, :]) * D + vcol[:, None], bf16_output(out, out_ptr))


@triton.jit
def _merge_kernel(po_ptr, pm_ptr, pl_ptr, sink_ptr, out_ptr, T, S: tl.constexpr, H: tl.constexpr,
                  D: tl.constexpr, BH: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M)), M = max(m_s, sink)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    dcol = tl.arange(0, D)
    sink = tl.load(sink_ptr + heads) * 1.4426950408889634
    mm = sink
    for s in tl.static_range(S):
        mm = tl.maximum(mm, tl.load(pm_ptr + (s * T + t).to(tl.int64) * H + heads))
    den = tl.exp2(sink - mm)
    num = tl.zeros([BH, D], tl.float32)
    for s in tl.static_range(S):
        row = (s * T + t).to(tl.int64) * H + heads
        wgt = tl.exp2(tl.load(pm_ptr + row) - mm)
        den += wgt * tl.load(pl_ptr + row)
        num += wgt[:, None] * tl.load(po_ptr + row[:, None] * D + dcol[None, :])
    out = num * (256.0 / den)[:, None]
    tl.store(out_ptr + (t.to(tl.int64) * H + heads[:, None]) * D + dcol[None, :], bf16_output(out, out_ptr))


def split_shares(n_sel: int, n_win: int, block_n: int, split: int) -> tuple[int, int, int]:
    """(splits, selected slots a split, window slots a split) of a (token, head block)'s entries: whole tiles a
    split, at most one split a tile of the longer list (split s takes slots [s * share, (s + 1) * share) of each,
    clipped to its count)."""
    split = max(1, min(int(split), max(triton.cdiv(n_sel, block_n), triton.cdiv(n_win, block_n), 1)))
    return (split, triton.cdiv(triton.cdiv(n_sel, block_n), split) * block_n,
            triton.cdiv(triton.cdiv(n_win, block_n), split) * block_n)


def split_outputs(q: torch.Tensor, split: int, float_out: bool):
    """The output [T, H, D] (bf16, or float32 holding its values) and, for split > 1, the partials _merge_kernel
    reads: sums [S, T, H, D], maxima and denominators [S, T, H] (float32); else the output in their places."""
    out = torch.empty_like(q, dtype=torch.float32 if float_out else torch.bfloat16)
    if split == 1:
        return out, out, out, out
    t, h, d = q.shape
    pm = torch.empty(split, t, h, dtype=torch.float32, device=q.device)
    return out, torch.empty(split, t, h, d, dtype=torch.float32, device=q.device), pm, torch.empty_like(pm)


def int32_offsets_reach(kv_packed, win, d: int) -> bool:
    """Whether the "entries" and "two_pass" layouts' int32 offsets address every entry of both caches (else
    only the "heads" layout takes them)."""
    return max(kv_packed.shape[0], win.shape[0]) * d // 4 < 2 ** 31


def _two_pass_fits(h: int) -> bool:
    """Whether the two passes' head blocks (64 heads, or all of fewer, at least 16) tile h heads."""
    return h >= 16 and h % min(64, h) == 0


def sparse_attn_triton(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink, scale=None,
                       block_h: int | None = None, block_n: int | None = None, num_warps: int = 8,
                       num_stages: int = 1, split: int | None = None, merge_heads: int = 8, d_split: int = 1,
                       layout: str | None = None, float_out: bool = False, two_pass: dict | None = None,
                       weight_bytes: int | None = None, wgmma: dict | None = None):
    """Triton sparse attention; same inputs and output as sparse_attn_reference.

    layout (module docstring): None picks "two_pass" in its bf16x2 form for a decode batch of 16+ tokens and
    for a prefill (no launch shape given) wherever its int32 offsets reach every cache entry and its head
    blocks tile the heads (below), else "entries" where the offsets reach, else "heads" -- the H200's best
    (benches/results/kernels-h200-run24a.md: prefill 2.69 ms against 4.39 for "entries", decode batch 64
    34.6 against 65.4 us). block_h heads share each program (None: 32 for
    "entries", 64 for "heads", which fills a Hopper warpgroup MMA; with block_n and split None too, a
    decode-sized "entries" call takes 64 heads x 32 entries in 2 splits), block_n entries per tile (None: 64
    for "entries"; for "heads" 32 when the tokens fill the SMs, else 16, which compiles without spills
    for the split decode path), split = programs per (token, head block) over the entry lists (None:
    enough to fill the SMs once, 1 for prefill), merged by a second kernel that also adds the sink.
    d_split = 2: two programs per (token, head block, split), each computing all of S but only half of
    the output columns: half the accumulator registers, no partials to merge, for 2x the QK^T work.
    layout="two_pass" (decode-sized calls, kernels/sparse_attn_decode.py): scores for all heads in one launch,
    the weighted sum over column blocks in a second; block_h and block_n as above (None: 64 and 64), its other
    launch options in the dict two_pass (sparse_attn_two_pass's keywords; num_warps, num_stages, split and
    d_split here do not apply).
    layout="wgmma" (kernels/sparse_attn_wgmma.py, Gluon on a Hopper GPU): one pass, each tile decoded once into shared
    memory, S and O by warpgroup MMAs; block_n 64 or 32, its other options in the dict wgmma (ahead).
    float_out: the bf16 output's values stored as float32 (rounded to nearest even in the kernel), what the
    reference numerics keep, without a widening copy. weight_bytes: the two passes' weights buffer (None: theirs,
    64 MB), which sets how many tokens a launch pair takes; on top of two_pass, default or given.
    Host side: no tensor is made on or copied from the host, nothing is read back (CUDA-graph safe)."""
    t, h, d = _check(q, kv_packed, kv_scale, idx, win, win_scale, win_idx, sink)
    if d % 64 or d & (d - 1):
        raise ValueError(f"sparse attention: head dim {d} must be a power of two >= 64")
    scale = d ** -0.5 if scale is None else scale
    wide = not int32_offsets_reach(kv_packed, win, d)
    # decode-sized: the tokens' 64-head blocks fill at most half the SMs, no launch shape given
    decode_sized = (layout in (None, "entries") and block_h is None and block_n is None and split is None
                    and d_split == 1 and h % 64 == 0 and 2 * t * (h // 64) <= sm_count(q.device))
    if layout is None and not wide and _two_pass_fits(h) and (
            t >= 16 if decode_sized else block_h is block_n is split is None and d_split == 1):
        # a decode batch of 16+ tokens and a prefill in the two passes' bf16x2 form (H200 run 24a: batch 64
        # 34.6 us with 128-entry tiles against 59.4 for the float32 form's and 65.4 for the one-pass decode
        # shape; a 4K prefill 2.69 ms against 4.39 for "entries"). The prefill with the passes' own launch options
        # since run 35 (at the 64 MB weights buffer, H100: 2,257 us against 2,312 under a 128-register cap with 64
        # output columns a pass-2 program, the form picked at 16 MB in 24a; the layer's prefill graph 0.977-0.990x
        # in the five roles with more than a window, twice, runs 35e/35f); options given in two_pass are taken as
        # they are
        layout = "two_pass"
        if two_pass is None:  # the same form at both widths; a decode batch on 128-entry tiles
            two_pass = {"decode": "bf16x2"}
            block_n = 128 if decode_sized else block_n
    if layout is None:
        layout = "heads" if wide else "entries"
    if layout not in ("heads", "entries", "two_pass", "wgmma"):
        raise ValueError(f"sparse attention: layout must be 'heads', 'entries', 'two_pass' or 'wgmma', got {layout!r}")
    if wide and layout not in ("heads", "wgmma"):  # the wgmma form addresses entries with int64 offsets
        raise ValueError(f"sparse attention: layout={layout!r} addresses the caches with int32 offsets; "
                         f"{max(kv_packed.shape[0], win.shape[0])} entries of dim {d} are too many")
    n_sel = idx.shape[1]
    if n_sel == 0:  # nothing selected (a layer without a global branch): the window's indices stand in as a
        idx = win_idx  # pointer never read (an empty tensor's is null, which a launch refuses)
    caches = (kv_packed.contiguous().view(torch.int16), kv_scale.contiguous().view(torch.uint8),
              idx.to(torch.int32).contiguous(), win.contiguous().view(torch.int32),
              win_scale.contiguous().view(torch.uint8), win_idx.to(torch.int32).contiguous())
    sink32 = sink.float().contiguous()
    if layout == "wgmma":  # the one-pass Gluon form (kernels/sparse_attn_wgmma.py), bf16 q as the two passes read it
        from kernels.sparse_attn_wgmma import sparse_attn_wgmma
        return sparse_attn_wgmma(q.to(torch.bfloat16).contiguous(), *caches, sink32, scale, block_n=block_n or 64,
                                 float_out=float_out, n_sel=n_sel, **(wgmma or {}))
    if layout == "two_pass":
        from kernels.sparse_attn_decode import sparse_attn_two_pass
        # q as bf16 (the values the kernels round it to as they load it): pass 1 reads q once per entry tile, and
        # a float32 q costs its program 176 B of spills under the prefill's 128-register cap and 2.8x the
        # shared-memory operations a loop (sm_90 SASS, triton 3.6; decode batch 64: 2.1x): a release layer's
        # 4K prefill spent ~3.7 ms in the two passes on a float32 q (H200 run 25a) against 2.69 on a bf16 one
        q = q.to(torch.bfloat16) if q.dtype == torch.float32 else q
        options = dict(two_pass or {}, **({"weight_bytes": weight_bytes} if weight_bytes else {}))
        return sparse_attn_two_pass(q.contiguous(), *caches, sink32, scale, block_h=min(block_h or 64, h),
                                    block_n=block_n or 64, float_out=float_out, n_sel=n_sel, **options)
    if d_split not in (1, 2):
        raise ValueError(f"sparse attention: d_split must be 1 or 2, got {d_split}")
    # decode: all 64 heads a program decode each entry once, 32-entry tiles, two splits (H200 run 17b: 65.5
    # vs 68.7 us for 32 heads x 64, split 1)
    if layout == "entries" and decode_sized:
        block_h, block_n, split = 64, 32, 2
    bh = min(block_h or (32 if layout == "entries" else 64), h)
    if h % bh:
        raise ValueError(f"head count {h} is not a multiple of the head block {bh}")
    n_win = win_idx.shape[1]
    if block_n is None:
        block_n = 64 if layout == "entries" else 32 if t * (h // bh) >= sm_count(q.device) else 16
    if split is None:
        split = max(1, sm_count(q.device) // max(1, t * (h // bh) * d_split))
    split, sel_per, win_per = split_shares(n_sel, n_win, block_n, split)
    out, po, pm, pl = split_outputs(q, split, float_out)
    kernel = _sparse_attn_kernel if layout == "heads" else _sparse_attn_t_kernel
    kernel[(t, split, (h // bh) * d_split)](
        q.contiguous(), *caches, sink32, out, po, pm, pl, t, n_sel, n_win, sel_per, win_per, qk_log2(scale),
        H=h, D=d, BH=bh, BN=block_n, DT=dot_dtype(), SPLIT=split > 1, DV=d // d_split, num_warps=num_warps,
        num_stages=num_stages)
    if split > 1:
        mh = min(merge_heads, h)
        _merge_kernel[(t, h // mh)](po, pm, pl, sink32, out, t, S=split, H=h, D=d, BH=mh, num_warps=4)
    return out
