"""The routed experts' decode path (a few (token, expert) pairs) on tensor cores: kernels/moe_gemv.py's split-K
GEMV with each FP4 word decoded straight into an mma.sync A fragment (Gluon, Hopper; GPU only).

Why: the CUDA-core GEMV spends ~6.5 SASS instructions a weight value (the fp16 placement, its convert, the scale,
one FFMA a token): 34 us of issue at full rate for a 39 us goal (notes/kernels.md's census). Here a thread's words
are the ones its A fragments hold (kernels/moe_rs.py's decode: two shifts, two lop3 and half a bf16x2 multiply a
value, the scale folded in) and mma.sync m16n8k16 does the products and the float32 sums. The vectors are the B
operand, in registers: its 8 columns a block's pairs' vectors (a program a pair: every column that pair's, the
sums kept from column 0; the decode step's widths: up to 8 pairs of one expert, moe_align's blocks).

A program is 64 weight rows (16 a warp) of a block over a K slice of `steps` 64-wide steps; each step's word, scale
and vector loads are straight-line code, so the compiler issues them ahead of the decodes. The vectors come in the
MMA's K order (moe_rs.RS_ORDER inside each 64 of the NIB order: x from the E4M3 round trip's `rs` store, or
permuted first; the gate/up stores h so for the down). Split K as the GEMV: partial sums added into a zeroed
float32 buffer, the last K split of a row block (an atomic counter) finishing it. The values: the same bf16 products
and float32 sums as the grouped forms (the plain numerics' h rounded to bf16 as theirs; the engine's hidden state
is a bf16 number already), in the MMA's order. Gluon has no interpreter: tests/test_kernels_moe_mma_gemv.py checks
it on a Hopper GPU, tests/test_kernels_compile_sm90.py compiles it here.
"""

from __future__ import annotations

import torch
import triton

from kernels import moe_f8, moe_gemv, moe_rs, moe_ws

if moe_ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    _sync_warps = getattr(gl, "barrier", None) or gl.thread_barrier  # gl.barrier from triton 3.7, 3.6's name

    @triton.constexpr_function
    def _mma_layout():
        """The [64 weight rows, 8 columns] sums of 4 warps' mma.sync m16n8k16, 16 rows a warp."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])

    @triton.constexpr_function
    def _vector_layout():
        """[64 MMA positions of a K step, 8 columns] as mma.sync's B fragments hold them (bf16, k_width 2): lane
        (g, q) of every warp has positions 2q + {0, 1} + 8 r1 + 16 r2 + 32 r3 (registers r) of column g. A pair of
        positions is adjacent in the vector's MMA order: one 32-bit load."""
        return gl.DistributedLinearLayout([[1, 0], [8, 0], [16, 0], [32, 0]],
                                          [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [[0, 0], [0, 0]], [], [64, 8])

    @triton.constexpr_function
    def _tile_layout():
        """[64 rows, 8 pairs] over 4 warps, a row's four pairs a thread: the last arriver's epilogue (moe_f8's groups
        of 32 rows)."""
        return gl.BlockedLayout([1, 4], [32, 1], [2, 2], [1, 0])

    @gluon.jit
    def _block(b, order_ptr, bbeg_ptr, bend_ptr, PAIRS: gl.constexpr, layout: gl.constexpr):
        """Block b's pairs [8] in `layout` (past its own: the first again, read and never stored) and their mask.
        PAIRS 1: block b is pair b; else up to 8 pairs of one expert, a block of kernels/moe.py's moe_align (order,
        first and end rows)."""
        j = gl.arange(0, 8, layout=layout)
        if PAIRS == 1:
            return b + j * 0, j == 0
        else:
            first = gl.load(bbeg_ptr + b)
            rows = first + j
            valid = rows < gl.load(bend_ptr + b)
            return gl.load(order_ptr + gl.where(valid, rows, first)), valid

    @gluon.jit
    def _next_block(b, bexp_ptr, NB):
        """The block after b of this program's (its first: its program id; then a grid's width on) and its expert:
        < 0 where the blocks end (moe_align's used blocks come first, its unused ones after: a program of the grid
        takes ceil(used / width) blocks and no unused block costs a program)."""
        nxt = b + gl.num_programs(0)
        return nxt, gl.load(bexp_ptr + nxt, mask=nxt < NB, other=-1)

    @gluon.jit
    def _row_sums(w_ptr, s_ptr, wb_ptr, sb_ptr, v_ptr, vrows, row0, k_first, KDIM: gl.constexpr,
                  STEPS: gl.constexpr, TWO: gl.constexpr):
        """W[row0 .. row0 + 63] V over K [k_first, k_first + 64 STEPS) (and Wb V if TWO, else W V again): two float32
        [64, 8] in the MMA's layout, column j the vector at v_ptr + vrows[j] (bf16, in the MMA's K order; vrows [8]
        in the B operand's columns). W: int32 words [rows, KDIM / 8] (NIB order), its E8M0 bytes [rows, KDIM / 32].
        Two accumulators a weight (even and odd steps), so the MMAs of one step do not wait on the last's."""
        words_layout: gl.constexpr = moe_rs._words_layout(64)
        bytes_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
        mma: gl.constexpr = _mma_layout()
        b_layout: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, bytes_layout))
        grp = gl.arange(0, 2, layout=gl.SliceLayout(0, bytes_layout))
        wrd = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_layout)))
        rows = (row0 + r).to(gl.int64)
        # a step's words: row, then its two 32-groups of four words; its bytes: row, then group
        soff = gl.expand_dims(rows, 1) * (KDIM // 32) + gl.expand_dims(grp, 0) + k_first // 32
        woff = gl.expand_dims(gl.expand_dims(rows, 1) * (KDIM // 8) + gl.expand_dims(grp * 4, 0), 2) \
            + gl.expand_dims(gl.expand_dims(wrd, 0), 1) + k_first // 8
        pos = gl.arange(0, 64, layout=gl.SliceLayout(1, _vector_layout()))
        voff = gl.expand_dims(pos, 1) + gl.expand_dims(vrows, 0) + k_first
        zero = gl.zeros([64, 8], gl.float32, mma)
        acc0, acc1, accb0, accb1 = zero, zero, zero, zero
        for s in gl.static_range(STEPS):
            vb = gl.convert_layout(gl.load(v_ptr + voff + 64 * s), b_layout, assert_trivial=True)
            acc0, acc1 = _step(w_ptr + woff + 8 * s, s_ptr + soff + 2 * s, vb, acc0, acc1, s % 2)
            if TWO:
                accb0, accb1 = _step(wb_ptr + woff + 8 * s, sb_ptr + soff + 2 * s, vb, accb0, accb1, s % 2)
        acc = acc0 + acc1
        if TWO:
            return acc, accb0 + accb1
        else:
            return acc, acc

    @gluon.jit
    def _step(words_ptrs, bytes_ptrs, vb, acc_even, acc_odd, ODD: gl.constexpr):
        """One 64-wide K step of a weight: its words and E8M0 bytes (`_row_sums`' pointers) decoded into A fragments
        and multiplied with the vector's B fragments vb into the even or the odd steps' sums."""
        f, words = moe_ws.fold_factors(gl.expand_dims(gl.load(bytes_ptrs), 2), gl.load(words_ptrs))
        a = moe_rs.a_fragments(words, f, gl.DotOperandLayout(0, _mma_layout(), 2))
        if ODD:
            return acc_even, mma_v2(a, vb, acc_odd)
        else:
            return mma_v2(a, vb, acc_even), acc_odd

    @gluon.jit
    def _arrived_last(cnt_ptr, b, KS: gl.constexpr):
        """moe_gemv._arrived_last: after this program's relaxed partial adds, one acq_rel increment of its (block b,
        row block) counter behind a barrier; True for the last of the KS K splits."""
        _sync_warps()
        done = gl.atomic_add(cnt_ptr + b * gl.num_programs(1) + gl.program_id(1), 1, sem="acq_rel")
        return done == KS - 1

    @gluon.jit
    def _tile_offsets(pair, valid, N: gl.constexpr, layout: gl.constexpr):
        """[64 rows of this program's row block, 8 pairs] -> (offsets pair * N + row, int64; the pairs' mask)."""
        rows = gl.program_id(1) * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        offs = gl.expand_dims(pair.to(gl.int64) * N, 0) + gl.expand_dims(rows, 1)
        # the mask over the whole tile (offs >= 0 always holds): gl.broadcast here spilled 4 B in the 8-pair
        # hidden-state gate/up on sm_90
        return offs, gl.expand_dims(valid, 0) & (offs >= 0)

    @gluon.jit
    def _mma_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, gu_ptr,
                            cnt_ptr, h_ptr, tw_ptr, NP, NB, limit, DIM: gl.constexpr, INTER: gl.constexpr,
                            TOPK: gl.constexpr, PAIRS: gl.constexpr, STEPS: gl.constexpr, KS: gl.constexpr,
                            FH: gl.constexpr, RB: gl.constexpr):
        """Program (blocks of pairs, 64 rows of I, K split): W1 x and W3 x of each pair over its K slice added into gu
        [2, P, I] (float32, zeroed); the last split of a block's row block (counter cnt [blocks, I / 64], zeroed)
        applies the clamped SwiGLU (FH: the engine's hidden state, w included) and stores h [P, I] bf16 in the down's
        MMA order (moe_rs.rs_h_column)."""
        mma: gl.constexpr = _mma_layout()
        tile: gl.constexpr = _tile_layout()
        b = gl.program_id(0)
        e = gl.load(bexp_ptr + b)
        while e >= 0:
            pair_v, valid_v = _block(b, order_ptr, bbeg_ptr, bend_ptr, PAIRS, gl.SliceLayout(0, _vector_layout()))
            g, u = _row_sums(w1_ptr, s1_ptr, w3_ptr, s3_ptr, x_ptr, (pair_v // TOPK).to(gl.int64) * DIM,
                             e.to(gl.int64) * INTER + gl.program_id(1) * 64, gl.program_id(2) * (64 * STEPS), DIM,
                             STEPS, True)
            pair_t, valid_t = _block(b, order_ptr, bbeg_ptr, bend_ptr, PAIRS, gl.SliceLayout(0, tile))
            offs_t, mask_t = _tile_offsets(pair_t, valid_t, INTER, tile)
            if KS > 1:
                pair, valid = _block(b, order_ptr, bbeg_ptr, bend_ptr, PAIRS, gl.SliceLayout(0, mma))
                offs, mask = _tile_offsets(pair, valid, INTER, mma)
                gl.atomic_add(gu_ptr + offs, g, mask=mask, sem="relaxed")  # ordered before the counter by _arrived_last
                gl.atomic_add(gu_ptr + NP * INTER + offs, u, mask=mask, sem="relaxed")
                if _arrived_last(cnt_ptr, b, KS):
                    _swiglu_store(h_ptr, tw_ptr, pair_t, valid_t, mask_t,
                                  gl.load(gu_ptr + offs_t, mask=mask_t, other=0.0, cache_modifier=".cg"),
                                  gl.load(gu_ptr + NP * INTER + offs_t, mask=mask_t, other=0.0, cache_modifier=".cg"),
                                  limit, INTER, FH, RB)
            else:
                _swiglu_store(h_ptr, tw_ptr, pair_t, valid_t, mask_t, gl.convert_layout(g, tile),
                              gl.convert_layout(u, tile), limit, INTER, FH, RB)
            b, e = _next_block(b, bexp_ptr, NB)

    @gluon.jit
    def _swiglu_store(h_ptr, tw_ptr, pair, valid, mask, g, u, limit, INTER: gl.constexpr, FH: gl.constexpr,
                      RB: gl.constexpr):
        """A row block's h [64 rows, 8 pairs] (the tile layout; pairs past the block's masked) from their gate and up
        sums (moe_gemv._gemv_swiglu_store's numerics, the grouped kernels' epilogue), stored bf16 where the down reads
        them."""
        if FH:  # w included
            h = moe_f8.swiglu_e4m3_values(g, u, gl.load(tw_ptr + pair, mask=valid, other=0.0), limit, 64, 8, RB)
        else:
            g = gl.minimum(g, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
            h = g / (1.0 + gl.exp(-g)) * u
        rows = gl.program_id(1) * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _tile_layout()))
        dst = h_ptr + gl.expand_dims(pair.to(gl.int64) * INTER, 0) + gl.expand_dims(moe_rs.rs_h_column(rows), 1)
        gl.store(dst, gl.convert_layout(h, _tile_layout()).to(gl.bfloat16), mask=mask)

    @gluon.jit
    def _mma_down_kernel(h_ptr, w2_ptr, s2_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, tw_ptr, out_ptr, ys_ptr,
                         cnt_ptr, NB, DIM: gl.constexpr, INTER: gl.constexpr, TOPK: gl.constexpr, PAIRS: gl.constexpr,
                         STEPS: gl.constexpr, KS: gl.constexpr, FH: gl.constexpr, RB: gl.constexpr):
        """Program (blocks of pairs, 64 rows of dim, K split): tw * W2 h of each pair over its K slice added into its
        token's row of out (float32, relaxed atomics); FH: act(W2 h) (w is in h), which needs the whole sum: the
        splits add into ys [P, dim] (zeroed) and the last (counter cnt [blocks, dim / 64], zeroed) rounds it into
        out (moe_gemv._gemv_down_kernel)."""
        mma: gl.constexpr = _mma_layout()
        b = gl.program_id(0)
        e = gl.load(bexp_ptr + b)
        while e >= 0:
            pair_v, valid_v = _block(b, order_ptr, bbeg_ptr, bend_ptr, PAIRS, gl.SliceLayout(0, _vector_layout()))
            y, y_again = _row_sums(w2_ptr, s2_ptr, w2_ptr, s2_ptr, h_ptr, pair_v.to(gl.int64) * INTER,
                                   e.to(gl.int64) * DIM + gl.program_id(1) * 64, gl.program_id(2) * (64 * STEPS),
                                   INTER, STEPS, False)
            pair, valid = _block(b, order_ptr, bbeg_ptr, bend_ptr, PAIRS, gl.SliceLayout(0, mma))
            dst, mask = _tile_offsets(pair // TOPK, valid, DIM, mma)
            if not FH:
                gl.atomic_add(out_ptr + dst, y * gl.expand_dims(gl.load(tw_ptr + pair, mask=valid, other=0.0), 0),
                              mask=mask, sem="relaxed")
            elif KS > 1:
                yp, ymask = _tile_offsets(pair, valid, DIM, mma)
                gl.atomic_add(ys_ptr + yp, y, mask=mask, sem="relaxed")  # ordered before the counter by _arrived_last
                if _arrived_last(cnt_ptr, b, KS):
                    total = gl.load(ys_ptr + yp, mask=mask, other=0.0, cache_modifier=".cg")
                    gl.atomic_add(out_ptr + dst, moe_f8.act(total, RB), mask=mask, sem="relaxed")
            else:
                gl.atomic_add(out_ptr + dst, moe_f8.act(y, RB), mask=mask, sem="relaxed")
            b, e = _next_block(b, bexp_ptr, NB)


def _steps(kdim: int, steps: int) -> tuple[int, int]:
    """64-wide K steps a program (the largest divisor of the step count <= steps) and the number of K splits."""
    n = kdim // 64
    s = max(d for d in range(1, max(1, min(steps, n)) + 1) if n % d == 0)
    return s, n // s


def fits(dim: int, inter: int) -> bool:
    """Whether this form tiles experts of these widths: 64-row blocks and 64-wide K steps both ways."""
    return dim % 64 == 0 and inter % 64 == 0


def moe_mma_gemv(x_mma, w1w, s1, w3w, s3, w2w, s2, topk_ids, tw, swiglu_limit: float, hidden: str | None, *,
                 blocks: tuple | None = None, steps: int = 8, down_steps: int = 6) -> torch.Tensor:
    """out float32 [T, dim] = the routed experts on T tokens (moe_fp4_triton's knob gemv_mma): x_mma bf16 [T, dim] in
    the MMA's K order (moe_rs.rs_columns of the NIB order), weights as int32 words, scales as bytes, tw float32 [T, k];
    hidden: moe._hidden's numerics or None. blocks: None, a program a pair (a negative id: expert 0 at weight 0); or
    kernels/moe.py moe_align's (order, expert, first, end) in blocks of up to 8 pairs of one expert, the B operand's
    columns (the decode step's widths). steps / down_steps: 64-wide K steps a program of the gate/up and of the down
    (at most; a divisor of the step count)."""
    if not moe_ws.HAVE_GLUON:
        raise RuntimeError("the tensor-core GEMV needs triton.experimental.gluon (triton >= 3.6)")
    t, dim = x_mma.shape
    p, k = topk_ids.numel(), topk_ids.shape[1]
    inter = w1w.shape[1]
    if not fits(dim, inter):
        raise ValueError(f"the tensor-core GEMV takes 64-row blocks and 64-wide K steps: dim {dim} and I {inter} "
                         "must be multiples of 64")
    fp8_hidden = hidden is not None
    ids, tw = moe_gemv.pair_experts(topk_ids, tw)
    if blocks is None:
        blocks, pairs = (ids, ids, ids, ids), 1  # block b: pair b of expert ids[b] (order, first, end unread)
    else:
        pairs = 8
    (st1, ks1), (st2, ks2) = _steps(dim, steps), _steps(inter, down_steps)
    nrb, nrb2 = inter // 64, dim // 64
    out, gu, cnt, ys, cnt2 = moe_gemv.split_k_buffers(t, dim, p, inter, nrb, nrb2 if fp8_hidden and ks2 > 1 else 0,
                                                      x_mma.device)
    h = torch.empty(p, inter, dtype=torch.bfloat16, device=x_mma.device)
    order, bexp, bbeg, bend = blocks
    nb = bexp.numel()  # at most p: the counters' rows
    # a program a pair; blocks: programs over a third of the list each take its blocks b, b + width, ... while used
    width = nb if pairs == 1 else -(-nb // 3)
    shared = dict(DIM=dim, INTER=inter, TOPK=k, PAIRS=pairs, FH=fp8_hidden, RB=hidden == "reference", num_warps=4)
    _mma_gate_up_kernel[(width, nrb, ks1)](x_mma.contiguous(), w1w, s1, w3w, s3, order, bexp, bbeg, bend, gu, cnt, h,
                                           tw, p, nb, float(swiglu_limit), STEPS=st1, KS=ks1, **shared)
    _mma_down_kernel[(width, nrb2, ks2)](h, w2w, s2, order, bexp, bbeg, bend, tw, out, ys, cnt2, nb, STEPS=st2,
                                         KS=ks2, **shared)
    return out


__all__ = ["fits", "moe_mma_gemv"]
