"""The prefill's grouped expert GEMMs with each FP4 tile decoded straight into the wgmma's register operand
(Gluon, Hopper; GPU only).

Why: the Triton kernels (kernels/moe.py) decode a tile in a blocked layout and move it to the MMA's register
layout through shared memory (a store and an ldmatrix a fragment), and wait on each MMA before the next decode.
Here the layout of the loaded words is chosen so that each thread decodes exactly the values its own A fragment
holds: a thread takes two adjacent words (16 values, one 32-group) of each of its two rows a 64-wide K step, and
the MMA's K order inside each step is permuted to match (`RS_ORDER`; the activation is stored in that order, the
gate/up's hidden state too, so the down GEMM reads it so). The decode of step i + 1 then runs while the tensor
cores work on step i (asynchronous wgmma, one step in flight), and the TMA copies of a ring of stages (one or two
K steps each) stay ahead; the raw boxes are read through plain row-major views (moe_ws.PLAIN2 / PLAIN3: triton 3.6
reads an unswizzled 8-bit NVMMA view otherwise). Several programs an SM hide one another's fills and epilogues, as
the Triton kernels' do.

The values are the Triton kernels' (the same bf16 products, float32 sums; only the order of the sums inside each
K step differs). Gluon has no interpreter: tests/test_kernels_moe_ws.py checks the form on a Hopper GPU,
tests/test_kernels_moe_rs.py its layouts and orders here, tests/test_kernels_compile_sm90.py compiles it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401 (the interpreter runs rs_h_column with it in view)

from kernels import moe_f8, moe_ws
from kernels._formats import e2m1_pairs_ptx, register_cap
from kernels.fp4_tiles import nib_position

if moe_ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


def rs_position(m: int) -> int:
    """The stored (NIB-order) column of MMA position m inside a 64-wide K step: bits (m0, m3, m4, m5, m1, m2).

    The A fragment of lane (group g, quad q) holds K = 2q + {0, 1} + 8 * r2 + 16 * r3 + 32 * r4 (registers r); the
    thread decodes words 2q and 2q + 1 of its row, so word 2q + r4's pair r2 + 2 r3, element r0, sits there."""
    bits = [(m >> b) & 1 for b in range(6)]
    return bits[0] | bits[3] << 1 | bits[4] << 2 | bits[5] << 3 | bits[1] << 4 | bits[2] << 5


RS_ORDER = tuple(rs_position(m) for m in range(64))  # MMA position -> stored column, inside each 64-wide step


def rs_columns(x: torch.Tensor) -> torch.Tensor:
    """[rows, K] in NIB order along K -> the MMA's order (`RS_ORDER` inside each 64 columns), a copy. RS_ORDER is a
    permutation of the column's bits, so this is a permute of views: no index tensor made on the host a call (which
    a CUDA graph's capture would refuse)."""
    bits = x.reshape(x.shape[0], -1, 2, 2, 2, 2, 2, 2)  # stored column bits s5 .. s0
    # MMA position bits m5 .. m0 = s3, s2, s1, s5, s4, s0 (rs_position: s = m0, m3, m4, m5, m1, m2 from bit 0)
    return bits.permute(0, 1, 4, 5, 6, 2, 3, 7).reshape(x.shape)


@triton.jit
def rs_h_column(n):
    """The stored column of hidden index n in h as the gate/up stores it for this form's down GEMM: its NIB
    column (fp4_tiles.nib_position), then rs_position's inverse on the low six bits."""
    c = nib_position(n)
    return ((c & -64) | (c & 1) | ((c >> 4) & 1) << 1 | ((c >> 5) & 1) << 2 | ((c >> 1) & 1) << 3
            | ((c >> 2) & 1) << 4 | ((c >> 3) & 1) << 5)


# one int32 word (8 nibbles) -> its eight NIB-ordered bf16 values times the factor in $9 (one 32-group)
_VALUES_PTX = ("{\n.reg .b32 m, s, q0, q1, q2, q3;\n" + e2m1_pairs_ptx("$8", outs=("q0", "q1", "q2", "q3"),
                                                                          factors=("$9", "$9"))
               + "".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, q{i};\n" for i in range(4)) + "}\n")

if moe_ws.HAVE_GLUON:
    _VALUES_ASM = gl.constexpr(_VALUES_PTX)
    _acc_layout = moe_ws._acc_layout  # the [BN, BM] accumulator of 4 warps' wgmma, as the warp-specialized form's

    @triton.constexpr_function
    def _words_layout(bn):
        """[BN rows, 2 groups, 4 words] of a 64-wide K step: lane (q, g) of warp w holds words 2q and 2q + 1 (group
        q // 2) of rows 16 w + g + {0, 8} (+ 64 a repeat): the rows and K of its own A fragment."""
        bn = getattr(bn, "value", bn)
        reg = [[0, 0, 1], [8, 0, 0]] + [[64 << i, 0, 0] for i in range((bn // 64).bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, [[0, 0, 2], [0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                          [[16, 0, 0], [32, 0, 0]], [], [bn, 2, 4])

    @gluon.jit
    def _a_operand(words, sbytes, BM: gl.constexpr):
        """Words [BN, 2, 4] int32 (`_words_layout`) and their groups' E8M0 bytes [BN, 2, 1] -> the decoded tile
        [BN, 64] bf16 in the wgmma's A layout (MMA K order: RS_ORDER), the scale folded in as
        fp4_tiles.fp4_decoded_folded does (NaN past FOLD_MAX_SCALE_BYTE)."""
        f, words = moe_ws.fold_factors(sbytes, words)
        return a_operand_scaled(words, f, BM)

    @gluon.jit
    def a_operand_scaled(words, f, BM: gl.constexpr):
        """Words [BN, 2, 4] int32 (`_words_layout`) and a bf16 factor a word (int32 lanes holding it twice) -> the
        tile [BN, 64] bf16 in the wgmma's A layout (MMA K order: RS_ORDER), each E2M1 value times 2^-126 times its
        word's factor (one rounding: the product, exact where it is a bf16 number)."""
        BN: gl.constexpr = words.shape[0]
        f, words = gl.broadcast(f, words)
        v = gl.inline_asm_elementwise(_VALUES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, f],
                                      dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # pair k = (v[2k], v[2k + 1]); [BN, group, word, e, p1, p0] after the joins (join adds the last axis)
        p0, p1, p2, p3 = gl.join(v[0], v[1]), gl.join(v[2], v[3]), gl.join(v[4], v[5]), gl.join(v[6], v[7])
        y = gl.join(gl.join(p0, p2), gl.join(p1, p3))
        y = gl.reshape(y, [BN, 2, 2, 2, 2, 2, 2])  # [BN, j2, j1, j0, e, p1, p0]
        y = gl.permute(y, (0, 3, 5, 6, 1, 2, 4))  # [BN, j0, p1, p0, j2, j1, e]: MMA position bits 5..0
        y = gl.reshape(y, [BN, 64])
        return gl.convert_layout(y, gl.DotOperandLayout(0, _acc_layout(BM), 2), assert_trivial=True)

    @gluon.jit
    def _issue(a_desc, x_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, xbuf, wraw, sraw, ready, i, r0, wrow, srow,
               nb, BX: gl.constexpr):
        """TMA copies of stage i (H 64-wide K steps): the activation rows of each step (BM, then BX more), then each
        weight's words and E8M0 bytes."""
        STAGES: gl.constexpr = ready.shape[0]
        H: gl.constexpr = abuf.shape[0] // STAGES
        NW: gl.constexpr = wraw.shape[0] // STAGES
        BM: gl.constexpr = abuf.shape[1]
        BN: gl.constexpr = wraw.shape[1]
        s = i % STAGES
        xbytes: gl.constexpr = x_desc.block_type.nbytes if BX > 0 else 0
        mbarrier.expect(ready.index(s), H * (a_desc.block_type.nbytes + xbytes)
                        + NW * (wa_desc.block_type.nbytes + sa_desc.block_type.nbytes))
        for h in gl.static_range(H):
            tma.async_copy_global_to_shared(a_desc, [r0, (i * H + h) * 64], ready.index(s), abuf.index(s * H + h))
            if BX > 0:
                tma.async_copy_global_to_shared(x_desc, [r0 + BM, (i * H + h) * 64], ready.index(s),
                                                xbuf.index(s * H + h))
        for j in gl.static_range(NW):
            if j == 0:
                w_desc, s_desc = wa_desc, sa_desc
            else:
                w_desc, s_desc = wb_desc, sb_desc
            tma.async_copy_global_to_shared(w_desc, [wrow, i * 8 * H], ready.index(s), wraw.index(j * STAGES + s))
            tma.async_copy_global_to_shared(s_desc, [srow + i * 2 * H, nb * BN], ready.index(s),
                                            sraw.index(j * STAGES + s))

    @gluon.jit
    def _stage(ring, words, i, accs, KSTAGES: gl.constexpr, BM: gl.constexpr, BX: gl.constexpr):
        """Stage i: wait for its copies; for each of its 64-wide K steps, decode each weight's tile into A registers
        and start its MMAs (over the BM rows, then the BX more), then wait until only these are in flight (the last
        step's done, this one's under the next decode). Once the last stage's MMAs are all done, copy stage
        i + STAGES - 1 into its place. accs: (a, b, a over the BX rows, b over them)."""
        a_desc, x_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, xbuf, wraw, sraw, ready, r0, wrow, srow, nb = ring
        acc_a, acc_b, acc_ax, acc_bx = accs
        STAGES: gl.constexpr = ready.shape[0]
        H: gl.constexpr = abuf.shape[0] // STAGES
        NW: gl.constexpr = wraw.shape[0] // STAGES
        BN: gl.constexpr = wraw.shape[1]
        words_layout: gl.constexpr = _words_layout(BN)
        bytes_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
        sbytes = sraw._reinterpret(gl.uint8, [sraw.shape[0], 2 * H, BN], moe_ws.PLAIN2)  # row-major, as copied
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        for h in gl.static_range(H):
            at = abuf.index(s * H + h).permute((1, 0))  # [64, BM], K-major
            wa = words.index(s).slice(2 * h, 2, dim=1).load(words_layout)
            ba = gl.expand_dims(sbytes.index(s).slice(2 * h, 2).permute((1, 0)).load(bytes_layout), 2)
            a_op = _a_operand(wa, ba, BM)
            acc_a = warpgroup_mma(a_op, at, acc_a, is_async=True)
            if BX > 0:
                xt = xbuf.index(s * H + h).permute((1, 0))  # [64, BX]
                acc_ax = warpgroup_mma(_x_operand(a_op, BX), xt, acc_ax, is_async=True)
            if NW == 2:
                wb = words.index(STAGES + s).slice(2 * h, 2, dim=1).load(words_layout)
                bb = gl.expand_dims(sbytes.index(STAGES + s).slice(2 * h, 2).permute((1, 0)).load(bytes_layout), 2)
                b_op = _a_operand(wb, bb, BM)
                acc_b = warpgroup_mma(b_op, at, acc_b, is_async=True)
                if BX > 0:
                    acc_bx = warpgroup_mma(_x_operand(b_op, BX), xt, acc_bx, is_async=True)
            acc_a, acc_b, acc_ax, acc_bx = warpgroup_mma_wait(num_outstanding=NW * (2 if BX > 0 else 1),
                                                              deps=(acc_a, acc_b, acc_ax, acc_bx))
            if h == 0:
                if i + STAGES - 1 < KSTAGES:
                    _issue(a_desc, x_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, xbuf, wraw, sraw, ready,
                           i + STAGES - 1, r0, wrow, srow, nb, BX)
        return acc_a, acc_b, acc_ax, acc_bx

    @gluon.jit
    def _x_operand(a_op, BX: gl.constexpr):
        """An A operand decoded for the BM rows' MMA as the BX rows' MMA takes it (the same registers: a fragment's
        layout is the M side's alone)."""
        return gl.convert_layout(a_op, gl.DotOperandLayout(0, _acc_layout(BX), 2), assert_trivial=True)

    @gluon.jit
    def _epilogue(acc_a, acc_b, row0, r1, nb, order_ptr, out_ptr, tw_ptr, limit, N: gl.constexpr,
                  TOPK: gl.constexpr, NW: gl.constexpr, RB: gl.constexpr):
        """The sums [BN, R] of rows row0 .. row0 + R - 1 (those < r1 real): gate/up (NW = 2) h stored in the down
        GEMM's MMA order; down, each pair's output added into its token's row."""
        BN: gl.constexpr = acc_a.shape[0]
        R: gl.constexpr = acc_a.shape[1]
        acc_layout: gl.constexpr = acc_a.type.layout
        rows = row0 + gl.arange(0, R, layout=gl.SliceLayout(0, acc_layout))
        rmask = rows < r1
        pair = gl.load(order_ptr + rows, mask=rmask, other=0)
        n_idx = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
        if NW == 2:
            h = moe_f8.swiglu_e4m3_values(acc_a, acc_b, gl.load(tw_ptr + pair, mask=rmask, other=0.0), limit, BN, R,
                                          RB)
            h = gl.convert_layout(h, acc_layout)
            col = rs_h_column(n_idx)  # the down GEMM reads h in its MMA order
            gl.store(out_ptr + gl.expand_dims(rows, 0).to(gl.int64) * N + gl.expand_dims(col, 1),
                     h.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rmask, 0))
        else:
            gl.atomic_add(out_ptr + gl.expand_dims(pair // TOPK, 0).to(gl.int64) * N + gl.expand_dims(n_idx, 1),
                          moe_f8.act(acc_a, RB), mask=gl.expand_dims(rmask, 0), sem="relaxed")

    @gluon.jit
    def _moe_rs_kernel(a_desc, x_desc, wa_desc, wb_desc, sa_desc, sb_desc, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr,
                       out_ptr, tw_ptr, limit, NBM, K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr,
                       NW: gl.constexpr, BM: gl.constexpr, BX: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, H: gl.constexpr, RB: gl.constexpr):
        """One (token block, BN weight rows) tile of a grouped FP4 GEMM over K, in stages of H 64-wide K steps: NW = 2,
        gate/up (out: h, stored in RS_ORDER along I); NW = 1, down (out: the [T, dim] float32 sums, each expert's
        output added). A token block of BM + BX rows (BX 0, or 16 / 32 more in MMAs of their own: blocks of 80 or 96
        pairs, where a power of two would leave a tile a third empty)."""
        KSTAGES: gl.constexpr = K // (64 * H)  # even where H = 1: grouped_rs checks K
        XR: gl.constexpr = BX if BX > 0 else 8  # (BX = 0: a placeholder never copied into)
        abuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES * H, BM, 64], a_desc.layout)
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES * H if BX > 0 else 1, XR, 64], x_desc.layout)
        wraw = gl.allocate_shared_memory(gl.int32, [NW * STAGES, BN, 8 * H], wa_desc.layout)
        sraw = gl.allocate_shared_memory(gl.uint8, [NW * STAGES, 2 * H, BN], sa_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        words = wraw._reinterpret(gl.int32, [NW * STAGES, BN, 2 * H, 4], moe_ws.PLAIN3)  # row-major, as copied
        e, nb, r0, r1 = moe_ws._tile(gl.program_id(0), (bexp_ptr, bbeg_ptr, bend_ptr, NBM, N // BN, GROUP_M))
        if e >= 0:
            wrow = e * N + nb * BN
            srow = e * (K // 32)
            for i in gl.static_range(STAGES - 1):
                if i < KSTAGES:
                    _issue(a_desc, x_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, xbuf, wraw, sraw, ready, i, r0,
                           wrow, srow, nb, BX)
            acc_a = gl.zeros([BN, BM], gl.float32, _acc_layout(BM))
            acc_b = gl.zeros([BN, BM], gl.float32, _acc_layout(BM))
            # the BX rows' sums (BX = 0: never written, so the compiler drops them)
            acc_ax = gl.zeros([BN, XR], gl.float32, _acc_layout(XR))
            acc_bx = gl.zeros([BN, XR], gl.float32, _acc_layout(XR))
            ring = (a_desc, x_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, xbuf, wraw, sraw, ready, r0, wrow, srow,
                    nb)
            # two K steps an iteration, each with its own A registers: a step's are written again only after the
            # wait that completes its MMAs (PTX forbids writing a wgmma's A registers while it is in flight)
            UNROLL: gl.constexpr = 2 // H
            for i in range(0, KSTAGES, UNROLL):
                for u in gl.static_range(UNROLL):
                    acc_a, acc_b, acc_ax, acc_bx = _stage(ring, words, i + u, (acc_a, acc_b, acc_ax, acc_bx), KSTAGES,
                                                          BM, BX)
            acc_a, acc_b, acc_ax, acc_bx = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b, acc_ax, acc_bx))
            _epilogue(acc_a, acc_b, r0, r1, nb, order_ptr, out_ptr, tw_ptr, limit, N, TOPK, NW, RB)
            if BX > 0:
                _epilogue(acc_ax, acc_bx, r0 + BM, r1, nb, order_ptr, out_ptr, tw_ptr, limit, N, TOPK, NW, RB)


def token_tile(block_m: int) -> tuple[int, int]:
    """A token block of block_m pairs as the form's two MMAs take it: (BM, BX), BM a power of two (64 or 128) and BX
    the rest (0, 16 or 32): 80 = 64 + 16, 96 = 64 + 32."""
    bm = 128 if block_m >= 128 else 64
    bx = block_m - bm
    if bx not in (0, 16, 32) or block_m > 128:
        raise ValueError(f"block_m {block_m}: the register-operand form takes 64, 80, 96 or 128-pair token blocks")
    return bm, bx


def grouped_rs(act, weights, scales_t, order, blocks, out, block_m: int, tw=None, limit: float = 0.0, topk: int = 1,
               block_n: int = 64, group_m: int = 4, stages: int = 4, bf16_acts: bool = True,
               maxnreg: int | None = None, stage_k: int = 64):
    """One grouped FP4 GEMM of the MoE in the register-operand form: as moe_ws.grouped_ws (the same arguments,
    64-wide K steps), but act [P, K] in the MMA's order along K (`rs_columns` of the NIB order), and the gate/up's
    h stored in that order along I (the down GEMM's act). block_m: 64, 80, 96 or 128 pairs a token block
    (`token_tile`). stage_k: the K of a ring stage, 64 or 128 (one wait and one set of copies for two steps)."""
    if not moe_ws.HAVE_GLUON:
        raise RuntimeError("the register-operand MoE form needs triton.experimental.gluon (triton >= 3.6)")
    p, kdim = act.shape
    nw = len(weights)
    n_rows = weights[0].shape[0] // (scales_t[0].shape[0] // (kdim // 32))  # rows an expert
    if (n_rows % block_n or block_n % 64 or kdim % 128 or nw not in (1, 2) or stage_k not in (64, 128)
            or stages < 2):
        raise ValueError(f"rows an expert {n_rows} must divide by block_n {block_n} (a multiple of 64), K {kdim} by "
                         "128 (K steps of 64, two an iteration), the weights be one (down) or two (gate/up), "
                         f"stage_k 64 or 128 (got {stage_k}) and stages at least 2 (got {stages}: one copy ahead)")
    bm, bx = token_tile(block_m)
    halves = stage_k // 64
    words = [w.contiguous().view(torch.int32) for w in weights]  # [E * N, K / 8]: a stage: BN rows of 8 words a step
    a_desc = moe_ws._descriptor(act, [bm, 64], 16, 128)
    x_desc = moe_ws._descriptor(act, [bx or 8, 64], 16, 128)  # the BX rows past BM (bx = 0: never read)
    w_descs = [moe_ws._descriptor(w, [block_n, 8 * halves], 32) for w in words]
    s_descs = [moe_ws._descriptor(s, [2 * halves, block_n], 8) for s in scales_t]
    bexp, bbeg, bend = blocks
    nbm = bexp.numel()
    _moe_rs_kernel[(nbm * (n_rows // block_n),)](
        a_desc, x_desc, w_descs[0], w_descs[-1], s_descs[0], s_descs[-1], order, bexp, bbeg, bend, out,
        tw if tw is not None else out, float(limit), nbm, K=kdim, N=n_rows, TOPK=topk, NW=nw, BM=bm, BX=bx,
        BN=block_n, GROUP_M=group_m, STAGES=stages, H=halves, RB=bf16_acts, num_warps=4, **register_cap(maxnreg))
    return out


__all__ = ["RS_ORDER", "grouped_rs", "rs_columns", "rs_h_column", "rs_position", "token_tile"]
