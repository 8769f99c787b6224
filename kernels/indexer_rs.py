"""The indexer's decode scoring with each FP4 key tile decoded straight into the wgmma's register operand (Gluon,
Hopper; GPU only).

Why: the Triton scoring kernel (kernels/indexer.py) holds each FP4 byte in a register of its own, packs four into a
word for the E4M3 bit assembly, unpacks the result, and moves every 32-wide group's operand to the MMA's layout
through shared memory between two CTA barriers: the sm_90 SASS of its decode loop is 448 instructions a thread for
128 keys (92 byte permutes, 12 barriers; `benches/compile_sm90.py --sass`), ~28 warp instructions a key, issue-bound
at ~30 us for 1M keys where the keys' bytes take ~16 us at the H200's copy rate.

Here the keys are the MMA's M side, as the MoE's weights are in kernels/moe_rs.py, and the same decode is used
(`moe_rs.a_operand_scaled`): a thread loads the two words of each of its two rows a 64-wide K step that its own A
fragment holds, and turns them into bf16 values with one multiply a pair; the query's K order is permuted to
match (`_natural`: an MMA position's NIB column, `moe_rs.RS_ORDER`, holds nibble (c & 7) // 2 + 4 (c & 1) of word
c // 8, the keys being packed in natural order). Measured (H100 run 44a): the scores of 1M keys 47.1 us against the
Triton kernel's 55.2; with the top-512 96.2 against 105.3 (44d). The values:
- each key's groups scaled relative to its largest scale byte: a value is E2M1 * 2^(s_g - s_max), exact in bf16,
  and the key's factor 2^(s_max - 127) multiplies its score after the ReLU and the head sum (it is positive);
- the query's heads likewise, 2^(s_max - 127) a head folded into its head weight;
- products exact in bf16 x bf16 -> float32, summed in float32 by the MMA (K = 128 in 8 steps of 16): the scores
  differ from the float64 reference by float32 rounding only (the Triton kernel's FP8 MMA keeps a group's exact
  dot, then rounds the same way).
One query a program column (decode: T < 16), 64 keys a tile, one warpgroup; the next tile's words are loaded before
this tile's decode. The kernel also writes the group maxima (groups of GM >= 64 keys) and zeroes the top-k counter,
as the Triton kernel's WRITE_MAX does, so kernels/topk.select_from_maxima follows unchanged. Gluon has no
interpreter: tests/test_kernels_glue_on_the_gpu.py checks the form on a Hopper GPU, tests/test_kernels_compile_sm90.py
compiles it here.
"""

from __future__ import annotations

import torch
import triton

from kernels import moe_rs, moe_ws
from kernels._formats import e8m0_value, fp4_value, register_cap, sm_count

if moe_ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

BN = 64  # keys a tile: the M of one warpgroup's wgmma
ABS_SHIFT = 64  # abs_scale: the keys' values carry 2^-64, the head weights 2^64 (the exact range's middle)

if moe_ws.HAVE_GLUON:
    _OPERAND = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    _ABS_SHIFT = gl.constexpr(ABS_SHIFT)
    _ABS_WEIGHT = gl.constexpr(2.0 ** ABS_SHIFT)

    @gluon.jit
    def _natural(m):
        """The natural K index (inside a 64-wide step) at MMA position m: its NIB column c = moe_rs.rs_position(m),
        whose value is nibble (c & 7) // 2 + 4 (c & 1) of word c // 8 (fp4_tiles.nib_position's inverse)."""
        c = (m & 1) | ((m >> 3) & 1) << 1 | ((m >> 4) & 1) << 2 | ((m >> 5) & 1) << 3 | ((m >> 1) & 1) << 4 \
            | ((m >> 2) & 1) << 5
        return (c & -8) | ((c >> 1) & 3) | ((c & 1) << 2)

    @gluon.jit
    def _pow2(e):
        """float32 2^e for integer lanes -149 <= e <= 127 (exact: subnormal below -126; _formats.e8m0_value covers
        only e >= -127)."""
        normal = ((gl.maximum(e, -126) + 127) << 23).to(gl.float32, bitcast=True)
        tiny = (1 << gl.maximum(e + 149, 0)).to(gl.float32, bitcast=True)
        return gl.where(e >= -126, normal, tiny)

    @gluon.jit
    def _largest_byte(word):
        """The largest of the four bytes of each int32 lane (a key's or a head's four E8M0 scale bytes)."""
        b0 = word & 255
        b1 = (word >> 8) & 255
        b2 = (word >> 16) & 255
        b3 = (word >> 24) & 255
        return gl.maximum(gl.maximum(b0, b1), gl.maximum(b2, b3))

    @gluon.jit
    def _query_step(qp_ptr, qs_ptr, qsb_ptr, row0, step: gl.constexpr, H: gl.constexpr):
        """The query's heads at the MMA positions of 64-wide K step `step`: [H, 64] bf16, each head's values
        E2M1 * 2^(s_g - s_max) (exact). qs_ptr: the heads' scale bytes as one int32 word a head, qsb_ptr: bytes."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        heads = row0 + gl.arange(0, H, layout=gl.SliceLayout(1, layout))
        k = step * 64 + _natural(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)))
        hmax = _largest_byte(gl.load(qs_ptr + heads))  # the head's four scale bytes as one word
        hk = gl.expand_dims(heads.to(gl.int64), 1)
        kk = gl.expand_dims(k, 0)
        b = gl.load(qp_ptr + hk * 64 + kk // 2).to(gl.int32) & 255
        code = (b >> ((kk & 1) * 4)) & 15
        sg = gl.load(qsb_ptr + hk * 4 + kk // 32).to(gl.int32)
        return (fp4_value(code) * _pow2(sg - gl.expand_dims(hmax, 1))).to(gl.bfloat16)

    @gluon.jit
    def _key_words(kw_ptr, rows, lim, step: gl.constexpr, layout: gl.constexpr):
        """Step `step`'s words [BN, 2, 4] of key rows `rows` (0 past lim) in `layout` (moe_rs._words_layout); rows
        count from kw_ptr (a tile's first key: int32 offsets within it)."""
        gi = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        wi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        r3 = gl.expand_dims(gl.expand_dims(rows, 1), 2)
        offs = r3 * 16 + gl.expand_dims(gl.expand_dims(step * 8 + gi * 4, 0), 2) \
            + gl.expand_dims(gl.expand_dims(wi, 0), 1)
        return gl.load(kw_ptr + offs, mask=r3 < lim, other=0)

    @gluon.jit
    def _key_tile(kw_ptr, ks_ptr, first, rel, n_vis, layout: gl.constexpr):
        """The tile of keys first + rel (0 past n_vis): its two steps' words (`_key_words`) and its scale words."""
        words = kw_ptr + first.to(gl.int64) * 16
        lim = n_vis - first
        return (_key_words(words, rel, lim, 0, layout), _key_words(words, rel, lim, 1, layout),
                gl.load(ks_ptr + first + rel, mask=rel < lim, other=0))

    @gluon.jit
    def _group_bytes(sw, step: gl.constexpr, layout: gl.constexpr):
        """The scale bytes of groups 2 step, 2 step + 1 of scale words sw [BN]: [BN, 2] int32 in `layout`'s slice."""
        gi = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        return (gl.expand_dims(sw, 1) >> gl.expand_dims((step * 2 + gi) * 8, 0)) & 255

    @gluon.jit
    def _factors(sw, kmax, step: gl.constexpr, layout: gl.constexpr):
        """The bf16 factor 2^(s_g - s_max + 126) of groups 2 step, 2 step + 1 (sw: the keys' scale words [BN], kmax
        their largest byte) as int32 lanes holding it twice, [BN, 2, 1] in `layout`; 0 below bf16's normal range."""
        e = _group_bytes(sw, step, layout) - gl.expand_dims(kmax, 1) + 253  # the biased exponent: 126 + 127
        f = gl.where(e >= 1, e << 7, 0)
        return gl.expand_dims(f | (f << 16), 2)

    @gluon.jit
    def _factors_absolute(sw, step: gl.constexpr, layout: gl.constexpr):
        """`_factors` without the key's largest byte: 2^(s_g - 65) (ABS_SHIFT = 64 under 2^(s_g - 1)), so that a
        value is E2M1 * 2^(s_g - 127 - 64), exact in bf16 while 66 <= s_g <= 192 (scales 2^-61 .. 2^65); bytes past
        192 held there (finite, inexact)."""
        f = gl.minimum(_group_bytes(sw, step, layout) + (126 - _ABS_SHIFT), 254) << 7
        return gl.expand_dims(f | (f << 16), 2)

    @gluon.jit
    def _indexer_rs_kernel(kw_ptr, ks_ptr, qp_ptr, qw_ptr, qs_ptr, qsb_ptr, w_ptr, nvis_ptr, out_ptr, max_ptr, cnt_ptr,
                           N, n_groups, chunk, stride_out, H: gl.constexpr, GM: gl.constexpr, WRITE_MAX: gl.constexpr,
                           BN: gl.constexpr, ABS: gl.constexpr = False, QPAIRS: gl.constexpr = False):
        """Scores of query t (program column) over keys [c * chunk, (c + 1) * chunk): tiles of BN keys, decoded into
        A registers, two async wgmmas of K = 64 against the query's heads in shared memory; score = the key's factor
        x sum over heads of the head weight x ReLU(dot), -inf past the query's visible count. A tile's words are
        loaded under the one before (two tiles before: 73.0 us against 71.5 for a 1M-key decode with its top-512,
        H100 run 45c). WRITE_MAX: the maxima of groups of GM keys (a multiple of BN) and the counter zeroed. ABS: each
        key's groups scaled absolutely (`_factors_absolute`: no largest byte a key, no factor a score; 2^64 in the head
        weights), exact for scale bytes in [66, 192] where the relative form is exact for all. QPAIRS: the query's
        heads decoded as a key tile is (its words qw_ptr, BN rows of which H are heads: the pairs' bit placement,
        where `_query_step` takes a byte load and a scale load a value), into [BN, 64] buffers of which the MMA reads
        the first H rows."""
        t = gl.program_id(0)
        c = gl.program_id(1)
        acc_layout: gl.constexpr = moe_ws._acc_layout(H)
        words_layout: gl.constexpr = moe_rs._words_layout(BN)
        wrows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, words_layout))
        arows: gl.constexpr = gl.SliceLayout(1, acc_layout)
        acols: gl.constexpr = gl.SliceLayout(0, acc_layout)
        rel = gl.arange(0, BN, layout=wrows)  # a tile's rows from its first key (the tile's pointers are scalars)
        if QPAIRS:
            qsw = gl.load(qs_ptr + t * H + rel, mask=rel < H, other=0)
            qmax = _largest_byte(qsw)
            qrow = qw_ptr + t.to(gl.int64) * (H * 16)
            qb0 = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], _OPERAND)
            qb1 = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], _OPERAND)
            qb0.store(moe_rs.a_operand_scaled(_key_words(qrow, rel, H, 0, words_layout),
                                              _factors(qsw, qmax, 0, words_layout), H))
            qb1.store(moe_rs.a_operand_scaled(_key_words(qrow, rel, H, 1, words_layout),
                                              _factors(qsw, qmax, 1, words_layout), H))
            q0 = qb0.slice(0, H)
            q1 = qb1.slice(0, H)
        else:
            q0 = gl.allocate_shared_memory(gl.bfloat16, [H, 64], _OPERAND)
            q1 = gl.allocate_shared_memory(gl.bfloat16, [H, 64], _OPERAND)
            q0.store(_query_step(qp_ptr, qs_ptr, qsb_ptr, t * H, 0, H))
            q1.store(_query_step(qp_ptr, qs_ptr, qsb_ptr, t * H, 1, H))
        fence_async_shared()
        heads = t * H + gl.arange(0, H, layout=acols)
        # each head's factor 2^(s_max - 127) folded into its weight (ReLU commutes with it)
        wq = gl.load(w_ptr + heads) * e8m0_value(_largest_byte(gl.load(qs_ptr + heads)))
        if ABS:
            wq = wq * _ABS_WEIGHT  # the keys' values carry 2^-ABS_SHIFT
        n_vis = gl.minimum(gl.load(nvis_ptr + t), N)
        if WRITE_MAX:
            if c == 0:
                gl.store(cnt_ptr + t, 0)
        out_row = out_ptr + t.to(gl.int64) * stride_out
        mrow = max_ptr + t.to(gl.int64) * n_groups
        n0 = c * chunk
        n_end = gl.minimum(n0 + chunk, N)
        w0, w1, sw = _key_tile(kw_ptr, ks_ptr, n0, rel, n_vis, words_layout)
        run = gl.full([BN], float("-inf"), gl.float32, arows)
        zero = gl.zeros([BN, H], gl.float32, acc_layout)
        for start in range(n0, n_end, BN):
            # the next tile's words, loaded under this one's work
            w0_next, w1_next, sw_next = _key_tile(kw_ptr, ks_ptr, start + BN, rel, n_vis, words_layout)
            if ABS:
                f0 = _factors_absolute(sw, 0, words_layout)
                f1 = _factors_absolute(sw, 1, words_layout)
            else:
                kmax = _largest_byte(sw)
                f0 = _factors(sw, kmax, 0, words_layout)
                f1 = _factors(sw, kmax, 1, words_layout)
            a0 = moe_rs.a_operand_scaled(w0, f0, H)
            acc = warpgroup_mma(a0, q0.permute((1, 0)), zero, use_acc=False, is_async=True)
            a1 = moe_rs.a_operand_scaled(w1, f1, H)
            acc = warpgroup_mma(a1, q1.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            cols = start + gl.arange(0, BN, layout=arows)
            score = gl.sum(gl.maximum(acc, 0.0) * gl.expand_dims(wq, 0), axis=1)
            if not ABS:
                # the keys' largest scale bytes again, in the accumulator's row layout (an L1 hit, where converting
                # kmax's layout would go through shared memory)
                score = score * e8m0_value(_largest_byte(gl.load(ks_ptr + cols, mask=cols < n_vis, other=0)))
            score = gl.where(cols < n_vis, score, float("-inf"))
            gl.store(out_row + cols, score, mask=cols < N)
            if WRITE_MAX:
                # the group's maxima a key row, reduced across the warps once a group (a reduction a tile was 12% of
                # the stall samples at its barrier, ncu run 45a; 1M-key decode with its top-512 70.9 us, 45b)
                run = gl.maximum(run, score)
                if ((start + BN) % GM == 0) | (start + BN >= n_end):
                    gl.store(mrow + start // GM, gl.max(run, axis=0))
                    run = gl.full([BN], float("-inf"), gl.float32, arows)
            w0, w1, sw = w0_next, w1_next, sw_next


def runs_on(device) -> bool:
    """Whether this form runs on the device: Gluon there and a Hopper GPU (the wgmma)."""
    return moe_ws.runs_on(device)


def supports(t: int, h: int, d: int, n: int, gm: int, pool_mask) -> bool:
    """Whether the register-operand form takes this call: Gluon there, decode rows, D = 128, 32 heads (the wgmma's N
    and the query tile's layout), groups of at least a tile, no candidate pool."""
    return moe_ws.HAVE_GLUON and t < 16 and d == 128 and h == 32 and gm % BN == 0 and pool_mask is None and n > 0


def indexer_scores_rs(q_packed, q_scale, k_packed, k_scale, weights, n_visible, out, maxima=None, counts=None,
                      gm: int = BN, chunk: int | None = None, programs_per_sm: int = 8, maxnreg: int | None = None,
                      abs_scale: bool = False, query_pairs: bool = False):
    """The scores [T, N] of `kernels.indexer.indexer_scores_triton`'s arguments into out (and, with maxima [T,
    n_groups], the maxima of groups of gm keys and the zeroed counts [T]) in the register-operand form (`supports`).
    chunk: keys a program (a multiple of gm; default ~programs_per_sm programs an SM over all queries). abs_scale: the
    keys' groups scaled absolutely (the kernel's ABS: fewer instructions a tile, exact for key scale bytes in [66,
    192] only). query_pairs: the query decoded by the keys' pair placement (the kernel's QPAIRS)."""
    t, h, half = q_packed.shape
    n = k_packed.shape[0]
    if not supports(t, h, 2 * half, n, gm, None):
        raise ValueError(f"the register-operand indexer form takes T < 16 queries of 32 heads, D = 128 and groups of a "
                         f"multiple of {BN} keys, got T {t}, H {h}, D {2 * half}, groups of {gm}")
    if chunk is None:
        chunk = triton.cdiv(n, max(1, programs_per_sm * sm_count(k_packed.device) // t))
    chunk = triton.cdiv(max(chunk, gm), gm) * gm
    write_max = maxima is not None
    kw = k_packed.contiguous().view(torch.int32)  # [N, 16]: a key's 16 words
    ks = k_scale.contiguous().view(torch.uint8).view(torch.int32).reshape(n)  # a key's four scale bytes, one word
    qsb = q_scale.contiguous().view(torch.uint8)
    qs = qsb.view(torch.int32).reshape(t * h)
    qp = q_packed.contiguous()
    _indexer_rs_kernel[(t, triton.cdiv(n, chunk))](
        kw, ks, qp, qp.view(torch.int32), qs, qsb, weights.float().contiguous(), n_visible.to(torch.int32).contiguous(),
        out, maxima if write_max else out, counts if write_max else out, n, maxima.shape[1] if write_max else 1, chunk,
        out.stride(0), H=h, GM=gm, WRITE_MAX=write_max, BN=BN, ABS=bool(abs_scale), QPAIRS=bool(query_pairs),
        num_warps=4, **register_cap(maxnreg))
    return out
