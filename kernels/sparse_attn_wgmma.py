"""The sparse attention prefill in one pass on Hopper's warpgroup MMAs (Gluon; GPU only).

Why: the Triton two passes (kernels/sparse_attn_decode.py, the prefill's default) decode every entry twice (scores,
then the weighted sum), pass the weights through global memory, and read a token's 64 KB query once per 64-entry
tile; Nsight and the census put them at a quarter of the issue slots, waiting on latency. Here one program (8 warps,
two warpgroups) takes one token's 64-head block: its query in shared memory once, then per tile of BN entries
(selected FP4 tiles, then FP8 window tiles) the entries decoded once into shared memory as bf16 [BN, D], and
- S [64 heads, BN] = Q . K^T by wgmma (both operands in shared memory; each warpgroup half of the entries),
- the online softmax in exp2 units (a row's max and sum across both warpgroups),
- O [64, D] += P . V by wgmma, P bf16 through shared memory (each warpgroup half of D: 128 accumulator registers),
and the next tile decoded into the other buffer while this tile's O MMAs run. The sink joins the denominator at the
end. Entries are decoded at kv / 256 (kernels/sparse_attn.py's fold: the FP4 bit placement's factor stays finite).

Values: the two passes' (the same decoded bf16 entries and bf16 query, float32 sums), but P is rounded to bf16 where
the two passes store float16 weights: a relative 2^-9 a weight instead of 2^-12 (tests/test_kernels_sparse_attn_
wgmma.py's GPU case holds it to the float64 reference). Gluon has no interpreter: the GPU test checks it, the sm_90
compile test compiles it anywhere.
"""

from __future__ import annotations

import torch
import triton

from kernels import moe_ws
from kernels._formats import E2M1_BF16_SCALED_PTX
from kernels.sparse_attn import _sink_scale, qk_log2

if moe_ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_init, warpgroup_mma_wait)

    _E2M1_ASM = gl.constexpr(E2M1_BF16_SCALED_PTX)
    # the CTA barrier: gl.barrier from triton 3.7, gl.thread_barrier in 3.6 (the device's)
    _sync_warps = getattr(gl, "barrier", None) or gl.thread_barrier

    @triton.constexpr_function
    def _acc_layout(n):
        """A [64, n] accumulator over two warpgroups, each n / 2 columns."""
        n = getattr(n, "value", n)
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, 16])

    # the MMAs' bf16 operands in shared memory (the query, the entry tiles): 128-byte swizzle
    _OPERAND = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    # a staged tile's raw bytes and scales: row-major, unswizzled (a chunk's rows contiguous)
    _RAW4 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
    _RAW3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    _RAW2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @triton.constexpr_function
    def _weights_layout(bn):
        """P [64, BN] bf16 in shared memory: a swizzle as wide as its rows (64 bytes at 32-entry tiles)."""
        return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * getattr(bn, "value", bn)), element_bitwidth=16,
                                    rank=2)

    @gluon.jit
    def _entries(row, start, end, BN: gl.constexpr, layout: gl.constexpr):
        """Entry indices [BN] at row[start, end) (-1 past end), in `layout`."""
        ar = start + gl.arange(0, BN, layout=layout)
        return gl.load(row + ar, mask=ar < end, other=-1)

    @gluon.jit
    def _gather_index(ent_row, start, end, BN: gl.constexpr, G: gl.constexpr, W: gl.constexpr,
                      raw: gl.constexpr):
        """A tile's gather over [BN entries, G scale groups, W bytes a group] in the layout `raw`: whether each
        entry is there [BN, 1], its row [BN, 1] (int64; 0 where not), the group [1, G] and byte [1, 1, W] indices."""
        ent = _entries(ent_row, start, end, BN, gl.SliceLayout(1, gl.SliceLayout(2, raw)))
        ok = gl.expand_dims(ent >= 0, 1)
        r = gl.expand_dims(gl.where(ent >= 0, ent, 0).to(gl.int64), 1)
        g = gl.expand_dims(gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, raw))), 0)
        j = gl.expand_dims(gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, raw))), 0), 1)
        return ok, r, g, j

    @triton.constexpr_function
    def _fp4_layout():
        """[BN entries, 8 scale groups, 8 bytes] of a 128-dim chunk over 8 warps: a thread's 8 bytes one group's."""
        return gl.BlockedLayout([1, 1, 8], [4, 8, 1], [8, 1, 1], [2, 1, 0])

    @gluon.jit
    def _decode_fp4(dst, sc, b):
        """A chunk's packed bytes b [BN, G, 8] and its groups' E4M3 scale bytes sc [BN, G] -> dst [BN, 16 G] bf16 (kv /
        256): bit assembly (kernels/_formats.py, 2.6 instructions a value), the scale times 2^118 as the factor."""
        BN: gl.constexpr = b.shape[0]
        f = (sc.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622794e+35).to(gl.bfloat16)
        f, b = gl.broadcast(gl.expand_dims(f, 2), b)
        lo, hi = gl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r,r,r", [b, f],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        dst.store(gl.reshape(gl.join(lo, hi), [BN, 16 * b.shape[1]]))  # dim 16 g + 2 j + nibble

    @gluon.jit
    def _fill_fp4(dst, kvb_ptr, kvs_ptr, ent_row, start, end, BN: gl.constexpr, D: gl.constexpr, DC: gl.constexpr):
        """FP4 entries -> dst [BN, D] bf16 (kv / 256), DC dims at a time, gathered from global memory."""
        G: gl.constexpr = DC // 16
        ok, r, g, j = _gather_index(ent_row, start, end, BN, G, 8, _fp4_layout())
        for c in gl.static_range(D // DC):
            sc = gl.load(kvs_ptr + r * (D // 16) + c * G + g, mask=ok, other=0)  # [BN, G]
            b = gl.load(kvb_ptr + gl.expand_dims(r * (D // 2) + c * (DC // 2) + g * 8, 2) + j,
                        mask=gl.expand_dims(ok, 2), other=0)  # [BN, G, 8] uint8
            _decode_fp4(dst.slice(c * DC, DC, dim=1), sc, b)

    @triton.constexpr_function
    def _staged_layout(bn, scales):
        """The copies of a staged FP4 tile over 8 warps (chunks of 128 dims): bytes [chunks, BN, 4, 16], 16 a thread
        (one cp.async of 16 bytes); scales [chunks, BN, 8], 8 a thread."""
        bn, scales = getattr(bn, "value", bn), getattr(scales, "value", scales)
        if scales:
            rows = max(bn // 32, 1)
            return gl.BlockedLayout([1, 1, 8], [1, 32, 1], [8 // rows, rows, 1], [2, 1, 0])
        rows = min(bn // 8, 8)
        return gl.BlockedLayout([1, 1, 1, 16], [1, 8, 4, 1], [8 // rows, rows, 1, 1], [3, 2, 1, 0])

    @gluon.jit
    def _staged_entries(ent_row, start, end, BN: gl.constexpr):
        """A selected tile's entry indices in the two copies' layouts (loaded a tile before their copies)."""
        lb: gl.constexpr = _staged_layout(BN, False)
        ls: gl.constexpr = _staged_layout(BN, True)
        return (_entries(ent_row, start, end, BN, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, lb)))),
                _entries(ent_row, start, end, BN, gl.SliceLayout(0, gl.SliceLayout(2, ls))))

    @gluon.jit
    def _stage_fp4(rb, rs, kvb_ptr, kvs_ptr, eb, es, D: gl.constexpr):
        """Asynchronous copies (cp.async, one group) of a selected tile's packed bytes into rb [D/128, BN, 4, 16] and
        E4M3 scales into rs [D/128, BN, 8], chunk-major (a chunk's rows contiguous for the decode's reads); absent
        entries (-1) zero-filled."""
        lb: gl.constexpr = _staged_layout(rb.shape[1], False)
        ls: gl.constexpr = _staged_layout(rb.shape[1], True)
        C: gl.constexpr = rb.shape[0]
        rb_ = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.where(eb >= 0, eb, 0).to(gl.int64), 0), 2), 3)
        cb = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, lb))))
        gb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, lb))))
        jb = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, lb))))
        off = (gl.expand_dims(gl.expand_dims(gl.expand_dims(cb * 64, 1), 2), 3)
               + gl.expand_dims(gl.expand_dims(gl.expand_dims(gb * 16, 0), 1), 3)
               + gl.expand_dims(gl.expand_dims(gl.expand_dims(jb, 0), 1), 2))
        okb = gl.expand_dims(gl.expand_dims(gl.expand_dims(eb >= 0, 0), 2), 3)
        async_copy.async_copy_global_to_shared(rb, kvb_ptr + rb_ * (D // 2) + off, mask=okb)
        rs_ = gl.expand_dims(gl.expand_dims(gl.where(es >= 0, es, 0).to(gl.int64), 0), 2)
        cs = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(2, ls)))
        gs = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, ls)))
        offs = gl.expand_dims(gl.expand_dims(cs * 8, 1), 2) + gl.expand_dims(gl.expand_dims(gs, 0), 1)
        async_copy.async_copy_global_to_shared(rs, kvs_ptr + rs_ * (D // 16) + offs,
                                               mask=gl.expand_dims(gl.expand_dims(es >= 0, 0), 2))
        async_copy.commit_group()

    @gluon.jit
    def _fill_staged(dst, rb, rs, BN: gl.constexpr, DC: gl.constexpr):
        """A staged FP4 tile (its copies waited on and visible) -> dst [BN, D] bf16 (kv / 256), chunk by chunk."""
        C: gl.constexpr = rb.shape[0]
        rows_b = rb._reinterpret(gl.uint8, [C * BN, 8, 8], _RAW3)  # chunk c: rows c BN .. c BN + BN - 1
        rows_s = rs._reinterpret(gl.uint8, [C * BN, 8], _RAW2)
        for c in gl.static_range(C):
            _decode_fp4(dst.slice(c * DC, DC, dim=1), rows_s.slice(c * BN, BN).load(gl.SliceLayout(2, _fp4_layout())),
                        rows_b.slice(c * BN, BN).load(_fp4_layout()))

    @gluon.jit
    def _fill_win(dst, winb_ptr, wins_ptr, ent_row, start, end, BN: gl.constexpr, D: gl.constexpr, DC: gl.constexpr):
        """FP8 window entries -> dst [BN, D] bf16 (kv / 256), DC dims at a time: E4M3 bytes [BN, DC/32 groups, 32]
        times their E8M0 scale / 256 (scales below 2^-118 taken as 2^-118, as the two passes do)."""
        G: gl.constexpr = DC // 32
        ok, r, g, j = _gather_index(ent_row, start, end, BN, G, 32,
                                    gl.BlockedLayout([1, 1, 16], [16 // G, G, 2], [8, 1, 1], [2, 1, 0]))
        for c in gl.static_range(D // DC):
            sc = gl.load(wins_ptr + r * (D // 32) + c * G + g, mask=ok, other=0).to(gl.int32)  # [BN, G]
            b = gl.load(winb_ptr + gl.expand_dims(r * D + c * DC + g * 32, 2) + j, mask=gl.expand_dims(ok, 2),
                        other=0)  # [BN, G, 32] uint8
            m = ((gl.maximum(sc, 9) - 8) << 23).to(gl.float32, bitcast=True)  # 2^(s - 127) / 256
            v = b.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(m, 2)
            dst.slice(c * DC, DC, dim=1).store(gl.reshape(v.to(gl.bfloat16), [BN, DC]))

    @gluon.jit
    def _fill(dst, i, n_st, idx_row, widx_row, n_sel, n_win, kvb_ptr, kvs_ptr, winb_ptr, wins_ptr,
              BN: gl.constexpr, D: gl.constexpr, DC: gl.constexpr):
        """Tile i (selected tiles first, then the window's) decoded into dst, then made visible to the MMAs."""
        if i < n_st:
            _fill_fp4(dst, kvb_ptr, kvs_ptr, idx_row, i * BN, n_sel, BN, D, DC)
        else:
            _fill_win(dst, winb_ptr, wins_ptr, widx_row, (i - n_st) * BN, n_win, BN, D, DC)
        fence_async_shared()
        _sync_warps()

    @gluon.jit
    def _tile_entries(i, n_st, idx_row, widx_row, n_sel, n_win, BN: gl.constexpr, s_layout: gl.constexpr):
        """Tile i's entry indices (selected tiles first, then the window's) along S's columns: its mask."""
        win = i >= n_st
        return _entries(gl.where(win, widx_row, idx_row), gl.where(win, i - n_st, i) * BN, gl.where(win, n_win, n_sel),
                        BN, gl.SliceLayout(0, s_layout))

    @gluon.jit
    def _softmax_step(s, ent, qk2, m_i, l_i, o):
        """Tile i's S (its empty slots masked: ent, `_tile_entries`) -> its weights P (bf16) and the running max and
        sum; O rescaled. l_i: the sum per head [64], or (LATE_SUM) per head and slot [64, BN], summed once at the end:
        no crossing of the warpgroups for it a tile."""
        s = gl.where(gl.expand_dims(ent >= 0, 0), s * qk2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout)), 1)
        if len(l_i.shape) == 2:
            l_i = l_i * gl.expand_dims(alpha, 1) + p
        else:
            l_i = l_i * alpha + gl.sum(p, axis=1)
        return p.to(gl.bfloat16), m_new, l_i, o

    @gluon.jit
    def _weighted_sum(pbuf, kbuf, p, o):
        """P into its buffer, made visible to the MMAs once every warp has stored its part (and is past its wait for
        the tile before's MMAs, the buffer's last readers), then O += P . V started (asynchronous)."""
        pbuf.store(p)
        fence_async_shared()
        _sync_warps()
        return warpgroup_mma(pbuf, kbuf, o, is_async=True)

    @gluon.jit
    def _sparse_attn_wgmma_kernel(q_ptr, kvb_ptr, kvs_ptr, idx_ptr, winb_ptr, wins_ptr, widx_ptr, sink_ptr, out_ptr,
                                  n_sel, n_win, qk2, H: gl.constexpr, D: gl.constexpr, BN: gl.constexpr,
                                  DC: gl.constexpr, AHEAD: gl.constexpr, LATE_SUM: gl.constexpr,
                                  STAGED: gl.constexpr, WIDE_STORE: gl.constexpr = False):
        """Token t = program 0, heads [64 program 1, +64): softmax(scale q . kv) . kv over its selected entries and
        window slots, with the sink in the denominator. AHEAD: S of tile i + 1 issued right after tile i's O MMAs
        and tile i + 2 decoded under both (three tile buffers); else S waited on as issued (two buffers). LATE_SUM:
        the softmax's sums kept per slot, added once at the end (two CTA barriers a tile fewer). STAGED (two
        buffers): each selected tile's raw bytes copied (cp.async) into shared memory a tile ahead, so the gather's
        latency runs under the tile before's S, softmax and O. WIDE_STORE: the output stored from the query's buffer
        in 16-byte pieces."""
        t = gl.program_id(0).to(gl.int64)
        h0 = gl.program_id(1) * 64
        s_layout: gl.constexpr = _acc_layout(BN)
        o_layout: gl.constexpr = _acc_layout(D)
        NBUF: gl.constexpr = 3 if AHEAD else 2
        qs = gl.allocate_shared_memory(gl.bfloat16, [64, D], _OPERAND)
        kb = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, D], _OPERAND)
        # staged: one weights buffer (tile i's P is stored past the softmax's CTA barriers, after every warp's wait
        # for tile i - 1's O MMAs, its readers)
        NP: gl.constexpr = 1 if STAGED else 2
        pb = gl.allocate_shared_memory(gl.bfloat16, [NP, 64, BN], _weights_layout(BN))
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        qh = gl.arange(0, 64, layout=gl.SliceLayout(1, q_layout))
        qd = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
        qs.store(gl.load(q_ptr + (t * H + h0 + gl.expand_dims(qh, 1)) * D + gl.expand_dims(qd, 0)))
        idx_row = idx_ptr + t * n_sel
        widx_row = widx_ptr + t * n_win
        n_st = gl.cdiv(n_sel, BN)
        n_t = n_st + gl.cdiv(n_win, BN)
        m_i = gl.full([64], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))  # finite: an empty tile sums to 0
        if LATE_SUM:
            l_i = gl.zeros([64, BN], gl.float32, s_layout)
        else:
            l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
        o = warpgroup_mma_init(gl.zeros([64, D], gl.float32, o_layout))  # carried as an MMA in flight
        s0 = gl.zeros([64, BN], gl.float32, s_layout)
        # every loop below runs at least once (an empty tile adds nothing): a path around the loop that zeroes O
        # where the loop's MMAs write it made ptxas serialize every wgmma (C7515)
        if AHEAD:
            _fill(kb.index(0), 0, n_st, idx_row, widx_row, n_sel, n_win, kvb_ptr, kvs_ptr, winb_ptr, wins_ptr, BN, D,
                  DC)
            # tile 0's S waited on here: O's zeros, which the compiler places after this MMA, are then set up with
            # no MMA in flight (C7515 otherwise)
            s = warpgroup_mma_init(warpgroup_mma(qs, kb.index(0).permute((1, 0)), s0, use_acc=False))
            for i in range(gl.maximum(n_t, 1)):
                # tile i + 1 into the buffer tile i - 2's MMAs read (every warp has waited on them since), under
                # tile i's S and tile i - 1's O
                _fill(kb.index((i + 1) % 3), i + 1, n_st, idx_row, widx_row, n_sel, n_win, kvb_ptr, kvs_ptr, winb_ptr,
                      wins_ptr, BN, D, DC)
                s, o = warpgroup_mma_wait(num_outstanding=0, deps=(s, o))
                ent = _tile_entries(i, n_st, idx_row, widx_row, n_sel, n_win, BN, s_layout)
                p, m_i, l_i, o = _softmax_step(s, ent, qk2, m_i, l_i, o)
                o = _weighted_sum(pb.index(i % 2), kb.index(i % 3), p, o)
                # S of tile i + 1 (past the last tile: a tile of nothing, never read), into S's spent registers
                s = warpgroup_mma(qs, kb.index((i + 1) % 3).permute((1, 0)), s, use_acc=False, is_async=True)
            s, o = warpgroup_mma_wait(num_outstanding=0, deps=(s, o))
        else:
            if STAGED:
                rb = gl.allocate_shared_memory(gl.uint8, [D // 128, BN, 4, 16], _RAW4)
                rs = gl.allocate_shared_memory(gl.uint8, [D // 128, BN, 8], _RAW3)
                eb, es = _staged_entries(idx_row, 0, n_sel, BN)
                _stage_fp4(rb, rs, kvb_ptr, kvs_ptr, eb, es, D)  # tile 0's copies (all masked off where none)
                eb, es = _staged_entries(idx_row, BN, n_sel, BN)  # tile 1's indices, for its copies under tile 0
            for i in range(gl.maximum(n_t, 1)):
                b = i % 2
                # tile i into its buffer (its last readers, tile i - 2's MMAs, are done: every warp has waited since),
                # under tile i - 1's O MMAs
                if STAGED and i < n_st:
                    async_copy.wait_group(0)
                    _sync_warps()  # every thread's copies landed
                    _fill_staged(kb.index(b), rb, rs, BN, DC)
                    fence_async_shared()
                    _sync_warps()  # the tile visible to the MMAs, and rb / rs read by every warp
                    if i + 1 < n_st:
                        _stage_fp4(rb, rs, kvb_ptr, kvs_ptr, eb, es, D)
                        eb, es = _staged_entries(idx_row, (i + 2) * BN, n_sel, BN)
                else:
                    _fill(kb.index(b), i, n_st, idx_row, widx_row, n_sel, n_win, kvb_ptr, kvs_ptr, winb_ptr, wins_ptr,
                          BN, D, DC)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                s = warpgroup_mma(qs, kb.index(b).permute((1, 0)), s0, use_acc=False)
                ent = _tile_entries(i, n_st, idx_row, widx_row, n_sel, n_win, BN, s_layout)
                p, m_i, l_i, o = _softmax_step(s, ent, qk2, m_i, l_i, o)
                o = _weighted_sum(pb.index(i % NP), kb.index(b), p, o)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            if STAGED:  # no copy left in flight past the program's end (a layer with no selected tile: tile 0's)
                async_copy.wait_group(0)
        heads = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        if LATE_SUM:
            l_i = gl.sum(l_i, axis=1)
        factor = gl.convert_layout(_sink_scale(sink_ptr, heads, m_i, l_i), gl.SliceLayout(1, o_layout))
        out = (o * gl.expand_dims(factor, 1)).to(gl.bfloat16)
        if WIDE_STORE:  # through the query's buffer (its last readers, the S MMAs, waited on in every warp before
            # the barrier) into the query's load layout: 16-byte stores, where the MMA layout's are 4-byte pairs
            # (in a layout of its own: the query's offsets, reused here, were kept across the loop and spilled)
            st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
            _sync_warps()
            qs.store(out)
            _sync_warps()
            sh = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, st_layout))
            sd = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
            gl.store(out_ptr + (t * H + gl.expand_dims(sh, 1)) * D + gl.expand_dims(sd, 0),
                     qs.load(st_layout).to(out_ptr.dtype.element_ty))
        else:
            oh = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
            od = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            gl.store(out_ptr + (t * H + gl.expand_dims(oh, 1)) * D + gl.expand_dims(od, 0),
                     out.to(out_ptr.dtype.element_ty))


_SHARED_LIMIT = 220 * 1024  # an sm_90 program's 227 KB, less room for the reductions' scratch


def wgmma_fits(h: int, d: int) -> bool:
    """Whether this form takes the shape: 64-head blocks, and a head dim whose query, two entry tiles and weights
    fit an SM's shared memory (D = 512, the release's: 64 + 2 x 64 + 16 KB at 64-entry tiles)."""
    return h % 64 == 0 and d in (128, 256, 512)


def runs_on(device) -> bool:
    """Whether the form runs here: Gluon and a Hopper GPU (as the Gluon experts)."""
    return moe_ws.runs_on(device)


def shared_bytes(d: int, block_n: int, ahead: bool, staged: bool = False) -> int:
    """The form's shared memory: the query, the entry tiles (three with ahead) and the two weights buffers, bf16;
    staged, one weights buffer and a selected tile's raw FP4 bytes and scales (D / 2 + D / 16 an entry)."""
    return (2 * (64 * d + (3 if ahead else 2) * block_n * d + (1 if staged else 2) * 64 * block_n)
            + (block_n * (d // 2 + d // 16) if staged else 0))


def sparse_attn_wgmma(q, kvb, kv_scale, idx, winb, win_scale, win_idx, sink, scale: float, block_n: int = 64,
                      ahead: bool = False, late_sum: bool = False, staged: bool = False, float_out: bool = False,
                      n_sel: int | None = None, wide_store: bool = False) -> torch.Tensor:
    """The one-pass wgmma form. q bf16 [T, H, D]; kvb the FP4 bytes (uint8 [N, D/2]), kv_scale their E4M3 bytes
    (uint8 [N, D/16]), winb the window's E4M3 bytes (uint8 [W, D]), win_scale its E8M0 bytes (uint8 [W, D/32]),
    indices int32 (-1 = none), sink float32 [H], all contiguous (sparse_attn_triton prepares them). block_n: entries a
    tile (64, or 32 for less shared memory). ahead: each tile's S issued before the next tile's decode, which then
    runs under it too (three tile buffers: at D = 512, 32-entry tiles only). late_sum: the softmax's sums kept per
    slot and added once at the end (the same sum in another order; two CTA barriers a tile fewer). staged: each
    selected tile's raw bytes copied into shared memory a tile ahead (cp.async; not with ahead). n_sel: the
    selected slots a row (None: idx's width). wide_store: the output stored through shared memory in 16-byte pieces
    (per-line Nsight 42d: the MMA layout's 4-byte stores 13.5% of the stall samples, LSU throttle and drain; the 4K
    prefill 1,354.6 us against 1,480.0, H100 run 44a; loading each tile's softmax mask before its fill and S MMA
    instead, for the 10% of the samples on that load's wait, was 1,595.6: removed). Returns bf16 [T, H, D]
    (float_out: those values as float32). Host side: nothing made on or read from the host."""
    if not moe_ws.HAVE_GLUON:
        raise RuntimeError("the wgmma sparse attention needs triton.experimental.gluon (triton >= 3.6)")
    t, h, d = q.shape
    if not wgmma_fits(h, d) or block_n not in (32, 64):
        raise ValueError(f"sparse attention (wgmma): needs heads a multiple of 64 (got {h}), head dim 128, 256 or 512 "
                         f"(got {d}) and block_n 32 or 64 (got {block_n})")
    if ahead and staged:
        raise ValueError("sparse attention (wgmma): staged copies run in the two-buffer loop, not with ahead")
    need = shared_bytes(d, block_n, ahead, staged)
    if need > _SHARED_LIMIT:
        raise ValueError(f"sparse attention (wgmma): {need} bytes of shared memory at head dim {d}, {block_n}-entry "
                         f"tiles{' ahead' if ahead else ''}: over {_SHARED_LIMIT}")
    n_sel = idx.shape[1] if n_sel is None else n_sel
    out = torch.empty_like(q, dtype=torch.float32 if float_out else torch.bfloat16)
    if t:
        _sparse_attn_wgmma_kernel[(t, h // 64)](
            q, kvb.view(torch.uint8), kv_scale.view(torch.uint8), idx, winb.view(torch.uint8),
            win_scale.view(torch.uint8), win_idx, sink, out, n_sel, win_idx.shape[1], qk_log2(scale), H=h, D=d,
            BN=block_n, DC=min(d, 128), AHEAD=ahead, LATE_SUM=late_sum, STAGED=staged,
            WIDE_STORE=wide_store, num_warps=8)
    return out


__all__ = ["runs_on", "shared_bytes", "sparse_attn_wgmma", "wgmma_fits"]
