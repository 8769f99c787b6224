"""Sparse attention for decode-sized calls in two passes: scores, then the weighted sum over column blocks.

Same inputs, output and numerics contract as kernels/sparse_attn.py's `sparse_attn_triton` (read its
docstring for the shapes); `sparse_attn_triton(..., layout="two_pass")` lands here.

Why two passes: with 64 heads sharing each 512-wide entry, one program that computes S = q.K^T and
accumulates P.V needs the whole [64, 512] float32 output tile in registers (128 a thread at 8 warps),
which is what spills and leaves one block an SM (H200 Nsight, run 18a). Splitting the output columns
over programs instead (d_split) recomputes S in every one. Here S is computed once, its softmax weights
written (small: a decode step's [T, 640, H] fit L2), and the weighted sum runs over column blocks:

  pass 1 (`_scores_kernel`), a program per (token, group of entry tiles, head block): S^T [BN, BH] of
      each tile, D in four chunks against the query's four [D/4, BH] chunks (loaded once a program); per
      tile and head its max m (log2 units) and l = sum 2^(s - m); P~ = 2^(s - m) stored as float16
      (in [0, 1]: 11 significant bits, 0 where no entry is).
  pass 2 (`_weighted_sum_kernel`), a program per (token, column block of DV, head block): the tiles'
      (m, l) give the row's max M (the sink included) and denominator; each tile's weights are
      P~ 2^(m - M), rounded to bf16 once for the MMA as the one-pass kernels round theirs, and
      O [BH, DV] += P [BH, BN] . V [BN, DV] over the tile's DV columns, decoded; then O / denominator.

Registers (sm_90 at the release's decode shapes, triton 3.6 / 3.7): pass 1 232 / 252 with 80 KB of shared
memory, pass 2 255 / 252 at DV 128, no spills: two blocks of 4 warps an SM. Every entry is decoded twice in
all (whole for S, a column block at a time for P.V); the weights are read once per column block, from L2.
H200 (runs 20b-20c, 64 tokens x 64 heads, 500 selected + 128 window entries): 58.6-59.1 us at one tile a
scoring program (scores 33.6-35.0 us, weighted sum 25.0 us) against 64.4-64.6 for the one-pass kernel.
Nsight (20c): both passes latency-bound at 2 warps a scheduler (issue 18% / 33%, 0.37 / 0.47 eligible
warps, DRAM 7% / 13%); running the loads ahead (20c) did not move them, so the wait is in the in-register
decode and its shared-memory round trip to the MMA operand, not in the gathers.

decode="bf16x2" (below the float32 form's kernels): heads as the MMA's M in both passes, the FP4 bytes assembled
into bf16 pairs by PTX, selected and window tiles in loops of their own. sm_90 SASS (triton 3.6, static,
benches/compile_sm90.py --sass): pass 1's loop 1,536 instructions a selected tile, the query's chunks read in it
(float32 form 4,086, its query read before), pass 2's 392 (1,085); 144 / 168 registers and 32 / 24 KB of shared
memory: 3 blocks an SM each (the float32 form: 2). Not yet timed on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import bf16_output, dot_dtype, e2m1_scaled_pairs, register_cap
from kernels.sparse_attn import _fp4_decode_g, _win_decode_g, qk_log2


@triton.jit
def _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, is_win, D: tl.constexpr, C0, DC: tl.constexpr):
    """_raw_tile_g without its branch: both formats' loads issued, one fully masked, so a tile's bytes can
    be requested before the loop body knows which decode runs (prefetching across the format change)."""
    ok = ent >= 0
    row = tl.where(ok, ent, 0)
    g = C0 // 16 + tl.arange(0, DC // 16)
    r3 = row[:, None, None] * (D // 4) + (g[:, None] * 4 + tl.arange(0, 4)[None, :])[None, :, :]
    okw = ok & (is_win != 0)
    okf = ok & (is_win == 0)
    x = tl.load(winw_ptr + r3, mask=okw[:, None, None], other=0) \
        | tl.load(kvh_ptr + r3, mask=okf[:, None, None], other=0).to(tl.int32)
    sc = tl.load(wins_ptr + row[:, None] * (D // 32) + g[None, :] // 2, mask=okw[:, None], other=0) \
        | tl.load(kvs_ptr + row[:, None] * (D // 16) + g[None, :], mask=okf[:, None], other=0)
    return x, sc


@triton.jit
def _decoded(x, sc, is_win, BN: tl.constexpr, DC: tl.constexpr, DT: tl.constexpr):
    """A chunk's raw lanes -> kv' = kv / 256 [BN, DC], DT (the format's decode: a uniform branch)."""
    if is_win:
        kv = _win_decode_g(x, sc, BN, DC, DT)
    else:
        kv = _fp4_decode_g(x, sc, BN, DC, DT)
    return kv


@triton.jit
def _entries(idx_row, widx_row, i, hi, n_st, n_sel, n_win, ar, BN: tl.constexpr):
    """Entry indices [BN] of tile i (selected tiles 0 .. n_st - 1, window tiles after); -1 past the end
    and for i >= hi (a tile this program does not own: no bytes are fetched for it). kernels/sparse_attn.py's
    _tile_ent with its ranges cut at the program's last tile computes the same, but timed slower in the
    weighted sum (H200, 64 tokens: 27.0 vs 24.6-24.9 us, three and two runs)."""
    win = i >= n_st
    start = tl.where(win, (i - n_st) * BN, i * BN)
    end = tl.where(win, n_win, n_sel)
    ent = tl.load(tl.where(win, widx_row, idx_row) + start + ar, mask=(start + ar < end) & (i < hi), other=-1)
    return ent


@triton.jit
def _store_weights(acc, ent, qk2, p_row, stat_row, i, ar, heads, BN: tl.constexpr, H: tl.constexpr):
    """Tile i's S^T [BN, BH] (acc, kv' units) -> its float16 weights 2^(s - m) and per head (m, l)."""
    s = tl.where((ent >= 0)[:, None], acc * qk2, float("-inf"))
    m = tl.maximum(tl.max(s, axis=0), -1.0e30)  # finite: a tile with no entry gives sum 0, not NaN
    p = tl.exp2(s - m[None, :])  # [BN, BH] in [0, 1]
    tl.store(p_row + (i * BN + ar)[:, None] * H + heads[None, :], p.to(tl.float16))
    tl.store(stat_row + i * 2 * H + heads, m)
    tl.store(stat_row + (i * 2 + 1) * H + heads, tl.sum(p, axis=0))


@triton.jit
def _scores_kernel(q_ptr, kvh_ptr, kvs_ptr, idx_ptr, winw_ptr, wins_ptr, widx_ptr, p_ptr, stat_ptr,
                   n_sel, n_win, n_st, n_t, qk2, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                   BN: tl.constexpr, TPP: tl.constexpr, DT: tl.constexpr):
    """Pass 1: token t, tiles [g * TPP, +TPP) of its selected-then-window tile list, heads [hb * BH, +BH).
    Loads run two D-chunks ahead of the decode: chunks 2 and 3 of a tile are requested while chunks 0 and
    1 are decoded and multiplied, chunks 0 and 1 of the next tile while 2 and 3 are."""
    t = tl.program_id(0)
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    DC: tl.constexpr = D // 4
    qc = q_ptr + (t.to(tl.int64) * H + heads[None, :]) * D + tl.arange(0, DC)[:, None]  # Q^T chunk [DC, BH]
    q0 = tl.load(qc).to(DT)
    q1 = tl.load(qc + DC).to(DT)
    q2 = tl.load(qc + 2 * DC).to(DT)
    q3 = tl.load(qc + 3 * DC).to(DT)
    ar = tl.arange(0, BN)
    idx_row = idx_ptr + t.to(tl.int64) * n_sel
    widx_row = widx_ptr + t.to(tl.int64) * n_win
    p_row = p_ptr + t.to(tl.int64) * n_t * BN * H
    stat_row = stat_ptr + t.to(tl.int64) * n_t * 2 * H
    lo = tl.program_id(1) * TPP
    hi = tl.minimum(lo + TPP, n_t)
    ent = _entries(idx_row, widx_row, lo, hi, n_st, n_sel, n_win, ar, BN)
    ent_next = _entries(idx_row, widx_row, lo + 1, hi, n_st, n_sel, n_win, ar, BN)
    x0, s0 = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, lo >= n_st, D, 0, DC)
    x1, s1 = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, lo >= n_st, D, DC, DC)
    for i in range(lo, hi):
        win = i >= n_st
        x2, s2 = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, win, D, 2 * DC, DC)
        acc = tl.dot(_decoded(x0, s0, win, BN, DC, DT), q0)
        x3, s3 = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, win, D, 3 * DC, DC)
        acc = tl.dot(_decoded(x1, s1, win, BN, DC, DT), q1, acc)
        ent_after = _entries(idx_row, widx_row, i + 2, hi, n_st, n_sel, n_win, ar, BN)
        x0, s0 = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent_next, i + 1 >= n_st, D, 0, DC)
        acc = tl.dot(_decoded(x2, s2, win, BN, DC, DT), q2, acc)
        x1, s1 = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent_next, i + 1 >= n_st, D, DC, DC)
        acc = tl.dot(_decoded(x3, s3, win, BN, DC, DT), q3, acc)
        _store_weights(acc, ent, qk2, p_row, stat_row, i, ar, heads, BN, H)
        ent = ent_next
        ent_next = ent_after


@triton.jit
def _weighted_sum_kernel(kvh_ptr, kvs_ptr, idx_ptr, winw_ptr, wins_ptr, widx_ptr, sink_ptr, p_ptr, stat_ptr,
                         out_ptr, n_sel, n_win, n_st, n_t, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                         BN: tl.constexpr, DV: tl.constexpr, NTP: tl.constexpr, DT: tl.constexpr):
    """Pass 2: token t, output columns [cb * DV, +DV), heads [hb * BH, +BH); O^T [DV, BH] += V^T [DV, BN] .
    P^T [BN, BH] (the decoded tile as the MMA's A operand: triton 3.6 fails OptimizeDotOperands with a
    decoded B). Tile i + 1's weights and V bytes (and tile i + 2's indices) load while tile i is used."""
    t = tl.program_id(0)
    c0 = tl.program_id(1) * DV
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    stat_row = stat_ptr + t.to(tl.int64) * n_t * 2 * H
    mx, den = _row_max_den(stat_row, sink_ptr, heads, n_t, NTP, H)
    ar = tl.arange(0, BN)
    idx_row = idx_ptr + t.to(tl.int64) * n_sel
    widx_row = widx_ptr + t.to(tl.int64) * n_win
    p_tile = p_ptr + t.to(tl.int64) * n_t * BN * H + ar[:, None] * H + heads[None, :]  # tile 0's [BN, BH]
    ent = _entries(idx_row, widx_row, 0, n_t, n_st, n_sel, n_win, ar, BN)
    ent_next = _entries(idx_row, widx_row, 1, n_t, n_st, n_sel, n_win, ar, BN)
    x, sc = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent, n_st <= 0, D, c0, DV)
    pw = tl.load(p_tile)
    acc = tl.zeros([DV, BH], tl.float32)  # O^T, kv' units (1/256)
    for i in range(0, n_t):
        ent_after = _entries(idx_row, widx_row, i + 2, n_t, n_st, n_sel, n_win, ar, BN)
        xn, sn = _raw_chunk(kvh_ptr, kvs_ptr, winw_ptr, wins_ptr, ent_next, i + 1 >= n_st, D, c0, DV)
        pn = tl.load(p_tile + (i + 1) * BN * H, mask=i + 1 < n_t, other=0.0)
        f = tl.exp2(tl.load(stat_row + i * 2 * H + heads) - mx)  # the tile's weights 2^(s - m_i) -> 2^(s - mx)
        v = _decoded(x, sc, i >= n_st, BN, DV, DT)
        acc = tl.dot(tl.trans(v), (pw.to(tl.float32) * f[None, :]).to(DT), acc)
        x, sc, pw = xn, sn, pn
        ent = ent_next
        ent_next = ent_after
    _store_out(acc, den, out_ptr, t, heads, c0, H, D, DV, 1)


@triton.jit
def _row_max_den(stat_row, sink_ptr, heads, n_t, NTP: tl.constexpr, H: tl.constexpr):
    """From the tiles' (m, l): per head the row's max (the sink included) and the softmax denominator."""
    tiles = tl.arange(0, NTP)[:, None]
    m = tl.load(stat_row + tiles * 2 * H + heads[None, :], mask=tiles < n_t, other=-1.0e30)  # [NTP, BH]
    lsum = tl.load(stat_row + (tiles * 2 + 1) * H + heads[None, :], mask=tiles < n_t, other=0.0)
    sink = tl.load(sink_ptr + heads) * 1.4426950408889634
    mx = tl.maximum(tl.max(m, axis=0), sink)
    return mx, tl.sum(lsum * tl.exp2(m - mx[None, :]), axis=0) + tl.exp2(sink - mx)


@triton.jit
def _store_out(acc, den, out_ptr, t, heads, c0, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               HA: tl.constexpr):
    """The output block (kv' units; heads along axis HA: O^T [DV, BH] has HA = 1, O [BH, DV] HA = 0) / the
    denominator -> the output's columns [c0, c0 + DV) of token t."""
    EA: tl.constexpr = 1 - HA
    out = acc * tl.expand_dims(256.0 / den, EA)
    col = c0 + tl.arange(0, DV)
    tl.store(out_ptr + (t.to(tl.int64) * H + tl.expand_dims(heads, EA)) * D + tl.expand_dims(col, HA),
             bf16_output(out, out_ptr))


# The bf16x2 form (decode="bf16x2"). Heads are the MMA's M in both passes: S [BH, BN] = Q . K^T with the decoded
# tile as the B operand (so a tile's softmax statistics reduce within a warp, where S^T's need shared memory
# across the warpgroup), O [BH, DV] += P . V with the weights as A; the weights are stored per head,
# [T, H, tiles * BN]. FP4 bytes are decoded by bit assembly into bf16 pairs (e2m1_scaled_pairs: about 2.6
# instructions a value where the float32 placement, multiply and rounding take about 9), window bytes by
# the native E4M3 conversion, both as plain 2-D tiles (triton 3.6 takes a decoded B operand only without the
# joins of the grouped lanes); selected and window tiles are walked in loops of their own, so no load of the
# other format is issued masked and no branch picks the decode.

@triton.jit
def _fp4_bytes(kvb_ptr, kvs_ptr, ent, D: tl.constexpr, C0, DC: tl.constexpr):
    """FP4 entries' packed bytes of dims [C0, C0 + DC) [BN, DC/2] (uint8) and their E4M3 scale bytes
    [BN, DC/16]; rows with ent < 0 read nothing."""
    ok = ent >= 0
    row = tl.where(ok, ent, 0).to(tl.int64)  # byte offsets (int32 ends at 2^23 entries of 512 dims)
    b = tl.load(kvb_ptr + row[:, None] * (D // 2) + C0 // 2 + tl.arange(0, DC // 2)[None, :], mask=ok[:, None],
                other=0)
    sc = tl.load(kvs_ptr + row[:, None] * (D // 16) + C0 // 16 + tl.arange(0, DC // 16)[None, :], mask=ok[:, None],
                 other=0)
    return b, sc


@triton.jit
def _fp4_bytes_decoded(b, sc, BN: tl.constexpr, DC: tl.constexpr, DT: tl.constexpr):
    """_fp4_bytes' tiles -> kv' = kv / 256 [BN, DC], DT: the scale times 2^118 (exact in bf16: E4M3 has 4
    significant bits) is the factor of e2m1_scaled_pairs, whose 2^-126 leaves kv * 2^-8."""
    f = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622794e+35).to(DT)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, DC // 16, 8)), (BN, DC // 2))
    lo, hi = e2m1_scaled_pairs(b, f, DT)
    return tl.interleave(lo, hi)


@triton.jit
def _win_bytes_decoded(winb_ptr, wins_ptr, ent, D: tl.constexpr, C0, DC: tl.constexpr, BN: tl.constexpr,
                       DT: tl.constexpr):
    """Window entries' dims [C0, C0 + DC) decoded: E4M3 bytes times their E8M0 scale / 256 (scales below
    2^-118 taken as 2^-118, as _win_decode does) -> [BN, DC], DT; rows with ent < 0 are zeros."""
    ok = ent >= 0
    row = tl.where(ok, ent, 0).to(tl.int64)  # byte offsets (int32 ends at 2^23 entries of 512 dims)
    b = tl.load(winb_ptr + row[:, None] * D + C0 + tl.arange(0, DC)[None, :], mask=ok[:, None], other=0)
    if DC >= 32:
        sc = tl.load(wins_ptr + row[:, None] * (D // 32) + C0 // 32 + tl.arange(0, DC // 32)[None, :],
                     mask=ok[:, None], other=0)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, DC // 32, 32)), (BN, DC))
    else:  # a chunk narrower than a scale group (small test shapes)
        sc = tl.load(wins_ptr + row[:, None] * (D // 32) + (C0 + tl.arange(0, DC))[None, :] // 32,
                     mask=ok[:, None], other=0)
    m = ((tl.maximum(sc.to(tl.int32), 9) - 8) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) / 256
    return (b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * m).to(DT)


@triton.jit
def _columns(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, C0, WIN: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
             DC: tl.constexpr, DT: tl.constexpr):
    """Dims [C0, C0 + DC) of the entries `ent`, all of one format, decoded: kv' [BN, DC], DT."""
    if WIN:
        v = _win_bytes_decoded(winb_ptr, wins_ptr, ent, D, C0, DC, BN, DT)
    else:
        b, sc = _fp4_bytes(kvb_ptr, kvs_ptr, ent, D, C0, DC)
        v = _fp4_bytes_decoded(b, sc, BN, DC, DT)
    return v


@triton.jit
def _tile_scores(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, qc, WIN: tl.constexpr, BN: tl.constexpr,
                 D: tl.constexpr, DT: tl.constexpr):
    """S [BH, BN] of one tile (kv' units); qc points at the query's first [BH, D/4] chunk. Each chunk is read
    just before its product, so one chunk's shared memory serves all four (sm_90, triton 3.6: 32 KB and 144
    registers, 3 blocks an SM, where the four chunks read up front took 80 KB and 192: 2)."""
    DC: tl.constexpr = D // 4
    acc = tl.dot(tl.load(qc).to(DT), tl.trans(_columns(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, 0, WIN, BN, D, DC,
                                                       DT)))
    for c in tl.static_range(1, 4):
        kv = _columns(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, c * DC, WIN, BN, D, DC, DT)
        acc = tl.dot(tl.load(qc + c * DC).to(DT), tl.trans(kv), acc)
    return acc


@triton.jit
def _store_head_weights(acc, ent, qk2, p_row, stat_row, i, ar, heads, NE, BN: tl.constexpr, H: tl.constexpr):
    """Tile i's S [BH, BN] -> its float16 weights 2^(s - m) at [head, i * BN + entry] of the token's
    [H, NE] and per head (m, l): _store_weights transposed. One helper for both (an axis constexpr) compiles
    the float32 form's pass 1 to other PTX than runs 20b-20d timed (its pointer arithmetic moves), so two."""
    s = tl.where((ent >= 0)[None, :], acc * qk2, float("-inf"))
    m = tl.maximum(tl.max(s, axis=1), -1.0e30)  # finite: a tile with no entry gives sum 0, not NaN
    p = tl.exp2(s - m[:, None])  # [BH, BN] in [0, 1]
    tl.store(p_row + heads[:, None] * NE + (i * BN + ar)[None, :], p.to(tl.float16))
    tl.store(stat_row + i * 2 * H + heads, m)
    tl.store(stat_row + (i * 2 + 1) * H + heads, tl.sum(p, axis=1))


@triton.jit
def _scores_bf16x2_kernel(q_ptr, kvb_ptr, kvs_ptr, idx_ptr, winb_ptr, wins_ptr, widx_ptr, p_ptr, stat_ptr,
                          n_sel, n_win, n_st, n_t, qk2, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr,
                          BN: tl.constexpr, TPP: tl.constexpr, DT: tl.constexpr):
    """Pass 1 of the bf16x2 form: tiles [g * TPP, +TPP), token t, heads [hb * BH, +BH) (a token's programs
    adjacent: its query is read from L2 after the first); the program's selected tiles, then its window tiles."""
    t = tl.program_id(1)
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    DC: tl.constexpr = D // 4
    q_chunk = q_ptr + (t.to(tl.int64) * H + heads[:, None]) * D + tl.arange(0, DC)[None, :]  # [BH, DC]
    ar = tl.arange(0, BN)
    idx_row = idx_ptr + t.to(tl.int64) * n_sel
    widx_row = widx_ptr + t.to(tl.int64) * n_win
    p_row = p_ptr + t.to(tl.int64) * n_t * BN * H
    stat_row = stat_ptr + t.to(tl.int64) * n_t * 2 * H
    lo = tl.program_id(0) * TPP
    hi = tl.minimum(lo + TPP, n_t)
    for i in range(lo, tl.minimum(hi, n_st)):
        ent = _entries(idx_row, widx_row, i, hi, n_st, n_sel, n_win, ar, BN)
        acc = _tile_scores(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, q_chunk, False, BN, D, DT)
        _store_head_weights(acc, ent, qk2, p_row, stat_row, i, ar, heads, n_t * BN, BN, H)
    for i in range(tl.maximum(lo, n_st), hi):
        ent = _entries(idx_row, widx_row, i, hi, n_st, n_sel, n_win, ar, BN)
        acc = _tile_scores(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, q_chunk, True, BN, D, DT)
        _store_head_weights(acc, ent, qk2, p_row, stat_row, i, ar, heads, n_t * BN, BN, H)


@triton.jit
def _head_weights(p_head, stat_row, i, heads, mx, BN: tl.constexpr, H: tl.constexpr, DT: tl.constexpr):
    """Tile i's weights [BH, BN] made 2^(s - mx) and rounded to DT once (the MMA's A operand)."""
    f = tl.exp2(tl.load(stat_row + i * 2 * H + heads) - mx)
    return (tl.load(p_head + i * BN).to(tl.float32) * f[:, None]).to(DT)


@triton.jit
def _weighted_sum_bf16x2_kernel(kvb_ptr, kvs_ptr, idx_ptr, winb_ptr, wins_ptr, widx_ptr, sink_ptr, p_ptr, stat_ptr,
                                out_ptr, n_sel, n_win, n_st, n_t, H: tl.constexpr, D: tl.constexpr,
                                BH: tl.constexpr, BN: tl.constexpr, DV: tl.constexpr, NTP: tl.constexpr,
                                DT: tl.constexpr):
    """Pass 2 of the bf16x2 form: output columns [cb * DV, +DV), token t, heads [hb * BH, +BH) (a token's
    programs adjacent: its weights are read from L2 after the first); O [BH, DV] += P [BH, BN] . V [BN, DV]
    over the selected tiles, then the window tiles."""
    t = tl.program_id(1)
    c0 = tl.program_id(0) * DV
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    stat_row = stat_ptr + t.to(tl.int64) * n_t * 2 * H
    mx, den = _row_max_den(stat_row, sink_ptr, heads, n_t, NTP, H)
    ar = tl.arange(0, BN)
    idx_row = idx_ptr + t.to(tl.int64) * n_sel
    widx_row = widx_ptr + t.to(tl.int64) * n_win
    p_head = p_ptr + t.to(tl.int64) * n_t * BN * H + heads[:, None] * (n_t * BN) + ar[None, :]  # tile 0's [BH, BN]
    acc = tl.zeros([BH, DV], tl.float32)  # O, kv' units (1/256)
    for i in range(0, n_st):
        ent = _entries(idx_row, widx_row, i, n_st, n_st, n_sel, n_win, ar, BN)
        v = _columns(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, c0, False, BN, D, DV, DT)
        acc = tl.dot(_head_weights(p_head, stat_row, i, heads, mx, BN, H, DT), v, acc)
    for i in range(n_st, n_t):
        ent = _entries(idx_row, widx_row, i, n_t, n_st, n_sel, n_win, ar, BN)
        v = _columns(kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, ent, c0, True, BN, D, DV, DT)
        acc = tl.dot(_head_weights(p_head, stat_row, i, heads, mx, BN, H, DT), v, acc)
    _store_out(acc, den, out_ptr, t, heads, c0, H, D, DV, 0)


def sparse_attn_two_pass(q, kvh, kv_scale, idx, win, win_scale, win_idx, sink, scale: float,
                         block_h: int = 64, block_n: int = 64, tiles_per_program: int = 1, block_v: int | None = None,
                         num_warps: int = 4, num_warps_sum: int | None = None, num_stages: int = 1,
                         maxnreg: int | None = None, maxnreg_sum: int | None = None,
                         float_out: bool = False, decode: str = "float32",
                         weight_bytes: int = 1 << 26, n_sel: int | None = None) -> torch.Tensor:
    """The two launches. Arguments as kernels/sparse_attn.py's kernels take them (kvh: the FP4 bytes as
    int16, win as int32 words, scales as bytes, indices int32, all contiguous; the caller checks shapes);
    block_h heads and block_n entries a tile in both passes, tiles_per_program tiles a pass-1 program,
    block_v output columns a pass-2 program (None: 128, or the head dim if smaller); maxnreg / maxnreg_sum: register caps for the two passes (more
    blocks an SM, at the cost of spills); decode: "float32" (each nibble placed in a float32 lane, scaled and
    rounded) or "bf16x2" (the FP4 bytes assembled into bf16 pairs, selected and window tiles in loops of their
    own; same values). weight_bytes bounds the float16 weights buffer between the passes ([T, tiles * block_n,
    H]: a 4K-token prefill's would be 335 MB): the tokens run in chunks that fit it, through one buffer (64 MB:
    819 tokens of the release's 640 entries x 64 heads, 6 launch pairs for 4K tokens; H100 run 34e, a 4K prefill:
    8 MB 2,697 us, 16 MB 2,688, 32 MB 2,460, 64 MB 2,334; in the layer, 16 -> 32 MB 0.993-0.994x (34e), 32 -> 64 MB
    0.988-0.998x in the four roles with selected entries, twice (35b, 35c), SWA roles within 0.5%). n_sel: the selected
    slots a row (None: idx's width; 0 with any int32 idx of T rows, never read: an empty tensor's null pointer
    would fail the launch).
    Host side: nothing made on or read from the host."""
    if decode not in ("float32", "bf16x2"):
        raise ValueError(f"sparse attention (two passes): decode must be 'float32' or 'bf16x2', got {decode!r}")
    t, h, d = q.shape
    block_v = block_v or min(128, d)
    if d % 64 or block_v > d or d % block_v or h % block_h or block_h < 16:
        raise ValueError(f"sparse attention (two passes): head dim {d} needs block_v {block_v} to divide it "
                         f"and head block {block_h} to divide {h} heads and be at least 16 (the MMA's N)")
    n_sel, n_win = idx.shape[1] if n_sel is None else n_sel, win_idx.shape[1]
    n_st, n_wt = triton.cdiv(n_sel, block_n), triton.cdiv(n_win, block_n)
    n_t = max(n_st + n_wt, 1)
    chunk = max(1, min(t, weight_bytes // (n_t * block_n * h * 2), 65535))  # 65535: a grid's y extent
    p = torch.empty(chunk, n_t * block_n, h, dtype=torch.float16, device=q.device)
    stats = torch.empty(chunk, n_t, 2, h, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q, dtype=torch.float32 if float_out else torch.bfloat16)
    dt = dot_dtype()
    scores, weighted_sum = _scores_kernel, _weighted_sum_kernel
    bf16x2 = decode == "bf16x2"
    if bf16x2:
        scores, weighted_sum = _scores_bf16x2_kernel, _weighted_sum_bf16x2_kernel
        kvh, win = kvh.view(torch.uint8), win.view(torch.uint8)
    groups, col_blocks = triton.cdiv(n_t, tiles_per_program), d // block_v
    for c0 in range(0, t, chunk):
        tc = min(chunk, t - c0)
        q_c, idx_c, widx_c = q[c0:c0 + tc], idx[c0:c0 + tc], win_idx[c0:c0 + tc]
        scores[(groups, tc, h // block_h) if bf16x2 else (tc, groups, h // block_h)](
            q_c, kvh, kv_scale, idx_c, win, win_scale, widx_c, p, stats, n_sel, n_win, n_st, n_t, qk_log2(scale),
            H=h, D=d, BH=block_h, BN=block_n, TPP=tiles_per_program, DT=dt, num_warps=num_warps,
            num_stages=num_stages, **register_cap(maxnreg))
        weighted_sum[(col_blocks, tc, h // block_h) if bf16x2 else (tc, col_blocks, h // block_h)](
            kvh, kv_scale, idx_c, win, win_scale, widx_c, sink, p, stats, out[c0:c0 + tc], n_sel, n_win, n_st, n_t,
            H=h, D=d, BH=block_h, BN=block_n, DV=block_v, NTP=triton.next_power_of_2(n_t), DT=dt,
            num_warps=num_warps_sum or num_warps, num_stages=num_stages, **register_cap(maxnreg_sum))
    return out
