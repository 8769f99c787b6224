"""The prefill's grouped expert GEMMs with the FP4 decode in warps of their own (Gluon, Hopper; GPU only).

Why: in the Triton kernels (kernels/moe.py) the same warps decode each FP4 tile and feed it to the MMA, so a
tile's decode and its MMA never overlap (register operand), and a decoded tile stored for the MMA costs a
proxy fence that stalls the pipeline's loads (the "halves" form of run 35a). Here the partitions of one
program share a ring of shared-memory stages:
- loader (1 warp): TMA copies of a stage's raw FP4 words, their E8M0 bytes (a transposed copy, so a
  stage's bytes are one box) and the activation rows (in expert order: the gate/up's gathered once, the
  down's h as the gate/up stores it, so a token block is one box);
- decoder (4 warps, or two groups on alternate K steps): the words to bf16 pairs with the scale folded in
  (kernels/_formats.e2m1_pairs_ptx, the same bits as fp4_tiles.fp4_decoded_folded), stored in the MMA's
  shared layout, then one proxy fence and an arrive: the fence waits on nothing but the decoder's own
  shared-memory stores;
- MMA (4 warps, the default partition): asynchronous wgmma on the decoded tiles (W1's and W3's, or W2's)
  against the activation tile, one stage in flight, then kernels/moe.py's epilogue (the engine's hidden
  state stored in expert order and NIB order along I; or each expert's output added into its token's row).
The values are the Triton kernels' (the same bf16 products, float32 sums in the MMA's K order). Gluon has
no interpreter: tests/test_kernels_moe_ws.py checks the form on a Hopper GPU; tests/test_kernels_compile_sm90.py
compiles it for sm_90 on any machine.
"""

from __future__ import annotations

import weakref

import torch
import triton

try:  # Gluon is experimental: triton 3.6 (the device) and 3.7 (CI) both have what is used here
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - an older triton
    HAVE_GLUON = False

from kernels import moe_f8
from kernels._formats import e2m1_pairs_ptx, register_cap, sm_count
from kernels.fp4_tiles import FOLD_FACTOR_OFFSET, FOLD_MAX_SCALE_BYTE

# one int32 word (8 nibbles) -> its four NIB-ordered bf16 pairs times the factor in $5 (= $6: one 32-group)
_PAIRS_PTX = "{\n.reg .b32 m, s;\n" + e2m1_pairs_ptx("$4") + "}\n"

if HAVE_GLUON:
    _PAIRS_ASM = gl.constexpr(_PAIRS_PTX)
    _FOLD_OFFSET = gl.constexpr(FOLD_FACTOR_OFFSET)
    _FOLD_MAX = gl.constexpr(FOLD_MAX_SCALE_BYTE)
    # plain row-major views of the TMA boxes read into registers (the raw words, the E8M0 bytes): a box copied
    # without swizzle lands row-major, which Gluon's unswizzled NVMMA layout need not describe on every version
    # (a layout of one rank less than its buffer: the leading dimension is the stage)
    PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    PLAIN3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))

    @gluon.jit
    def _tile(t, tiles):
        """Tile t of `tiles` = (the blocks' expert, first and end pointers, NBM token blocks, NBN weight-row blocks,
        GROUP_M; NBM * NBN tiles) -> (expert (< 0: none), N block, first and end row in expert order): GROUP_M
        consecutive token blocks (mostly one expert) sweep all N blocks together, so each weight tile is fetched from
        HBM about once."""
        bexp_ptr, bbeg_ptr, bend_ptr, nbm, nbn, group_m = tiles
        per_group = group_m * nbn
        first = (t // per_group) * group_m
        size = gl.minimum(nbm - first, group_m)
        mb = first + (t % per_group) % size
        return gl.load(bexp_ptr + mb), (t % per_group) // size, gl.load(bbeg_ptr + mb), gl.load(bend_ptr + mb)

    @gluon.jit
    def _loader(a_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, wraw, sraw, wdec, bars, tiles, KSTEPS, NROWS,
                first, stride):
        """TMA copies, stage by stage over this program's tiles: the NW weights' words and E8M0 bytes (raw_ready),
        then the activation rows (mma_ready, beside the decoder's arrive) once the MMA has released the stage."""
        raw_ready, raw_empty, mma_ready, mma_empty = bars
        STAGES: gl.constexpr = abuf.shape[0]
        BK: gl.constexpr = abuf.shape[2]
        BN: gl.constexpr = wdec.shape[1]
        NW: gl.constexpr = wraw.shape[0] // STAGES
        G: gl.constexpr = BK // 32
        c = 0  # the ring's steps so far (every partition counts the same ones)
        for t in range(gl.program_id(0), tiles[3] * tiles[4], gl.num_programs(0)):
            e, nb, r0, r1 = _tile(t, tiles)
            if e >= 0:
                wrow = e * NROWS + nb * BN
                srow = e * KSTEPS * G
                for i in range(KSTEPS):
                    s = (c + i) % STAGES
                    ph = ((c + i) // STAGES) & 1
                    mbarrier.wait(raw_empty.index(s), ph ^ 1)
                    fence_async_shared()  # the decoder's reads of this stage before the copy's writes
                    mbarrier.expect(raw_ready.index(s), NW * (wa_desc.block_type.nbytes + sa_desc.block_type.nbytes))
                    for j in gl.static_range(NW):
                        if j == 0:
                            w_desc, s_desc = wa_desc, sa_desc
                        else:
                            w_desc, s_desc = wb_desc, sb_desc
                        tma.async_copy_global_to_shared(w_desc, [wrow, i * (BK // 8)], raw_ready.index(s),
                                                        wraw.index(j * STAGES + s))
                        tma.async_copy_global_to_shared(s_desc, [srow + i * G, nb * BN], raw_ready.index(s),
                                                        sraw.index(j * STAGES + s))
                    mbarrier.wait(mma_empty.index(s), ph ^ 1)
                    mbarrier.expect(mma_ready.index(s), a_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(a_desc, [r0, i * BK], mma_ready.index(s), abuf.index(s))
                c += KSTEPS

    @triton.constexpr_function
    def _words_layout(groups):
        groups = getattr(groups, "value", groups)
        return gl.BlockedLayout([1, 1, 4], [32 // groups, groups, 1], [4, 1, 1], [2, 1, 0])

    @gluon.jit
    def fold_factors(sbytes, words):
        """E8M0 bytes (any shape broadcasting against `words`) -> the folded factor 2^(s - 1) as a bf16x2 pair of
        itself in int32 lanes, as fp4_tiles.fp4_bytes_folded makes it (NaN past FOLD_MAX_SCALE_BYTE), broadcast to
        the words' shape; returns (factors, words)."""
        b = sbytes.to(gl.int32)
        f = gl.where(b <= _FOLD_MAX, (b + _FOLD_OFFSET) << 7, 0x7FC0)
        return gl.broadcast(f | (f << 16), words)

    @gluon.jit
    def _decoded(words, sbytes):
        """Words [BN, BK/32, 4] int32 and their group's E8M0 bytes [BN, BK/32, 1] -> [BN, BK/2] int32 bf16 pairs
        (NIB order), the scale folded in as fp4_tiles.fp4_decoded_folded does (NaN past FOLD_MAX_SCALE_BYTE)."""
        f, words = fold_factors(sbytes, words)
        p0, p1, p2, p3 = gl.inline_asm_elementwise(_PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [words, f, f],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)
        # join adds a last axis: [..., i, j] of join(join(a, b), join(c, d)) is (a, c)[j] then (b, d)[j] at i = 1, so
        # pair p = 2 i + j comes from join(join(p0, p2), join(p1, p3))
        pairs = gl.join(gl.join(p0, p2), gl.join(p1, p3))
        return gl.reshape(pairs, [words.shape[0], words.shape[1] * 16])

    @gluon.jit
    def _decoder(a_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, wraw, sraw, wdec, bars, tiles, KSTEPS, NROWS,
                 first, stride):
        """The ring's steps first, first + stride, ... over this program's tiles: each stage's raw words to bf16
        tiles in the MMA's shared layout, one proxy fence and an arrive a stage (two decoders take alternate steps,
        one's latency under the other's work)."""
        raw_ready, raw_empty, mma_ready, mma_empty = bars
        STAGES: gl.constexpr = abuf.shape[0]
        BK: gl.constexpr = abuf.shape[2]
        BN: gl.constexpr = wdec.shape[1]
        NW: gl.constexpr = wraw.shape[0] // STAGES
        G: gl.constexpr = BK // 32
        # the copied rows of BK/8 words seen as [BN, G, 4] (row-major: the same bytes), a thread one 32-group of one
        # row (four words, 16 bytes)
        words = wraw._reinterpret(gl.int32, [wraw.shape[0], BN, G, 4], PLAIN3)
        sbytes = sraw._reinterpret(gl.uint8, [sraw.shape[0], G, BN], PLAIN2)
        words_layout: gl.constexpr = _words_layout(BK // 32)
        bytes_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
        pairs_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        # the same bytes as int32 pairs: the 128-byte rows swizzle alike at either width (the whole buffer, then a
        # stage: a view's own reinterpretation is not relied on to keep its offset)
        wpairs = wdec._reinterpret(gl.int32, [wdec.shape[0], BN, BK // 2], pairs_layout)
        c = 0
        for t in range(gl.program_id(0), tiles[3] * tiles[4], gl.num_programs(0)):
            e, nb, r0, r1 = _tile(t, tiles)
            if e >= 0:
                for i in range((first + stride - c % stride) % stride, KSTEPS, stride):
                    s = (c + i) % STAGES
                    ph = ((c + i) // STAGES) & 1
                    mbarrier.wait(raw_ready.index(s), ph)
                    wa = words.index(s).load(words_layout)
                    ba = gl.expand_dims(sbytes.index(s).permute((1, 0)).load(bytes_layout), 2)
                    if NW == 2:
                        wb = words.index(STAGES + s).load(words_layout)
                        bb = gl.expand_dims(sbytes.index(STAGES + s).permute((1, 0)).load(bytes_layout), 2)
                    mbarrier.arrive(raw_empty.index(s))
                    pa = _decoded(wa, ba)
                    if NW == 2:
                        pb = _decoded(wb, bb)
                    mbarrier.wait(mma_empty.index(s), ph ^ 1)
                    wpairs.index(s).store(pa)
                    if NW == 2:
                        wpairs.index(STAGES + s).store(pb)
                    fence_async_shared()  # the stores before the MMA's (async proxy) reads
                    mbarrier.arrive(mma_ready.index(s))
                c += KSTEPS

    @gluon.jit
    def _mma_steps(abuf, wdec, bars, acc_a, acc_b, c, KSTEPS):
        """A tile's K loop from the ring's step c: asynchronous wgmma on each stage (one or two decoded weights against
        the activation tile), one stage in flight; each stage released once its MMAs are done, the last one too (the
        ring goes on into this program's next tile)."""
        raw_ready, raw_empty, mma_ready, mma_empty = bars
        STAGES: gl.constexpr = abuf.shape[0]
        NW: gl.constexpr = wdec.shape[0] // STAGES
        for i in range(KSTEPS):
            s = (c + i) % STAGES
            mbarrier.wait(mma_ready.index(s), ((c + i) // STAGES) & 1)
            at = abuf.index(s).permute((1, 0))  # [BK, BM], K-major
            acc_a = warpgroup_mma(wdec.index(s), at, acc_a, is_async=True)
            if NW == 2:
                acc_b = warpgroup_mma(wdec.index(STAGES + s), at, acc_b, is_async=True)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=NW, deps=(acc_a, acc_b))
            mbarrier.arrive(mma_empty.index((c + i + STAGES - 1) % STAGES), pred=i > 0)
        acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
        mbarrier.arrive(mma_empty.index((c + KSTEPS - 1) % STAGES))
        return acc_a, acc_b

    @triton.constexpr_function
    def _acc_layout(bm):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                         instr_shape=[16, getattr(bm, "value", bm), 16])

    @gluon.jit
    def _mma_tile(abuf, wdec, bars, order_ptr, nb, r0, r1, c, KSTEPS):
        """A tile's sums [BN weight rows, BM pairs] (two for gate/up), its pairs' rows in expert order, their mask and
        pair ids, and its weight rows' indices."""
        BM: gl.constexpr = abuf.shape[1]
        BN: gl.constexpr = wdec.shape[1]
        acc_layout: gl.constexpr = _acc_layout(BM)
        zero = gl.zeros([BN, BM], gl.float32, acc_layout)
        acc_a, acc_b = _mma_steps(abuf, wdec, bars, zero, zero, c, KSTEPS)
        rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        rmask = rows < r1
        pair = gl.load(order_ptr + rows, mask=rmask, other=0)
        n_idx = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
        return acc_a, acc_b, rows, rmask, pair, n_idx

    @gluon.jit
    def _gate_up_mma(abuf, wdec, bars, h_ptr, tw_ptr, order_ptr, limit, tiles, KSTEPS, INTER, RB: gl.constexpr):
        """The MMA partition of the gate/up GEMM, then each tile's engine hidden state (kernels/moe.py's epilogue)
        stored in expert order, NIB order along I."""
        BM: gl.constexpr = abuf.shape[1]
        BN: gl.constexpr = wdec.shape[1]
        c = 0
        for t in range(gl.program_id(0), tiles[3] * tiles[4], gl.num_programs(0)):
            e, nb, r0, r1 = _tile(t, tiles)
            if e >= 0:
                acc1, acc3, rows, rmask, pair, n_idx = _mma_tile(abuf, wdec, bars, order_ptr, nb, r0, r1, c, KSTEPS)
                h = moe_f8.swiglu_e4m3_values(acc1, acc3, gl.load(tw_ptr + pair, mask=rmask, other=0.0), limit, BN, BM,
                                              RB)
                h = gl.convert_layout(h, _acc_layout(BM))  # the reshapes' layout is this one, by another name
                col = (n_idx & -8) | ((n_idx & 3) << 1) | ((n_idx >> 2) & 1)  # fp4_tiles.nib_position
                gl.store(h_ptr + gl.expand_dims(rows, 0).to(gl.int64) * INTER + gl.expand_dims(col, 1),
                         h.to(h_ptr.dtype.element_ty), mask=gl.expand_dims(rmask, 0))
                c += KSTEPS

    @gluon.jit
    def _down_mma(abuf, wdec, bars, out_ptr, order_ptr, tiles, KSTEPS, DIM, TOPK, RB: gl.constexpr):
        """The MMA partition of the down GEMM, then each tile's expert outputs as the numerics' act stores them,
        added into their tokens' rows (relaxed: nothing in this launch reads out)."""
        c = 0
        for t in range(gl.program_id(0), tiles[3] * tiles[4], gl.num_programs(0)):
            e, nb, r0, r1 = _tile(t, tiles)
            if e >= 0:
                acc, _, rows, rmask, pair, n_idx = _mma_tile(abuf, wdec, bars, order_ptr, nb, r0, r1, c, KSTEPS)
                gl.atomic_add(out_ptr + gl.expand_dims(pair // TOPK, 0).to(gl.int64) * DIM + gl.expand_dims(n_idx, 1),
                              moe_f8.act(acc, RB), mask=gl.expand_dims(rmask, 0), sem="relaxed")
                c += KSTEPS

    @gluon.jit
    def _moe_ws_kernel(a_desc, wa_desc, wb_desc, sa_desc, sb_desc, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, out_ptr,
                       tw_ptr, limit, NBM, K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, NW: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, RB: gl.constexpr, DECODE_REGS: gl.constexpr, DECODERS: gl.constexpr):
        """(token block, N block) tiles of a grouped FP4 GEMM over K, tiles pid, pid + programs, ... (one a program
        unless launched persistent): NW = 2, gate/up (out: h); NW = 1, down (out: the [T, dim] float32 sums)."""
        G: gl.constexpr = BK // 32
        abuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
        wraw = gl.allocate_shared_memory(gl.int32, [NW * STAGES, BN, BK // 8], wa_desc.layout)
        sraw = gl.allocate_shared_memory(gl.uint8, [NW * STAGES, G, BN], sa_desc.layout)
        dec_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        wdec = gl.allocate_shared_memory(gl.bfloat16, [NW * STAGES, BN, BK], dec_layout)
        raw_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        raw_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mma_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mma_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(raw_ready.index(j), count=1)
            mbarrier.init(raw_empty.index(j), count=1)
            mbarrier.init(mma_ready.index(j), count=2)  # the activation's copy and the decoder's arrive
            mbarrier.init(mma_empty.index(j), count=1)
        bars = (raw_ready, raw_empty, mma_ready, mma_empty)
        KSTEPS: gl.constexpr = K // BK
        # worker arguments must be values, not constants
        c0, c1, c2 = gl.to_tensor(0), gl.to_tensor(1), gl.to_tensor(2)
        tiles = (bexp_ptr, bbeg_ptr, bend_ptr, NBM, gl.to_tensor(N // BN), gl.to_tensor(GROUP_M))
        head = (a_desc, wa_desc, wb_desc, sa_desc, sb_desc, abuf, wraw, sraw, wdec, bars, tiles, KSTEPS, N)
        up_args = (abuf, wdec, bars, out_ptr, tw_ptr, order_ptr, limit, tiles, KSTEPS, N, RB)
        down_args = (abuf, wdec, bars, out_ptr, order_ptr, tiles, KSTEPS, N, TOPK, RB)
        one, two = head + (c0, c1), head + (c1, c2)
        if DECODERS == 2:
            if NW == 2:
                gl.warp_specialize([(_gate_up_mma, up_args), (_loader, one), (_decoder, head + (c0, c2)),
                                    (_decoder, two)], [1, 4, 4], [40, DECODE_REGS, DECODE_REGS])
            else:
                gl.warp_specialize([(_down_mma, down_args), (_loader, one), (_decoder, head + (c0, c2)),
                                    (_decoder, two)], [1, 4, 4], [40, DECODE_REGS, DECODE_REGS])
        else:
            if NW == 2:
                gl.warp_specialize([(_gate_up_mma, up_args), (_loader, one), (_decoder, one)], [1, 4],
                                   [40, DECODE_REGS])
            else:
                gl.warp_specialize([(_down_mma, down_args), (_loader, one), (_decoder, one)], [1, 4],
                                   [40, DECODE_REGS])


def runs_on(device) -> bool:
    """Whether this form runs on `device`: a Hopper GPU (its wgmma and TMA) with Gluon at hand."""
    device = torch.device(device)
    return (HAVE_GLUON and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


def gluon_fits(dim: int, inter: int) -> bool:
    """Whether both Gluon forms (this one and kernels/moe_rs.py) tile both GEMMs of experts of these widths: rows an
    expert in 64-row blocks and K in 128-wide pairs of steps, for the gate/up (N = inter, K = dim) and the down
    (N = dim, K = inter). The release's 5120 and 2304 do; the shipped small model's 32-row experts do not."""
    return dim % 128 == 0 and inter % 128 == 0


def transposed_scales(scale: torch.Tensor, n_experts: int) -> torch.Tensor:
    """E8M0 bytes [E * N, K/32] -> [E * K/32, N] uint8 (each expert's bytes transposed): a stage's bytes for BN
    rows and one K step are then one TMA box. Made once per weight (the caller caches it)."""
    s = scale.contiguous().view(torch.uint8)
    s = s.reshape(-1, s.shape[-1])
    rows, groups = s.shape
    return s.view(n_experts, rows // n_experts, groups).transpose(1, 2).contiguous().view(n_experts * groups, -1)


_TRANSPOSED: dict = {}


def cached_transposed_scales(scale: torch.Tensor, n_experts: int) -> torch.Tensor:
    """`transposed_scales`, made once for as long as `scale` (the same tensor object) lives: a weight's copy costs
    1/16 of its FP4 bytes of memory (283 MB for a release layer's W1 and W3)."""
    for key in [k for k, (ref, _) in _TRANSPOSED.items() if ref() is None]:
        del _TRANSPOSED[key]
    hit = _TRANSPOSED.get(id(scale))
    if hit is None or hit[0]() is not scale:
        hit = (weakref.ref(scale), transposed_scales(scale, n_experts))
        _TRANSPOSED[id(scale)] = hit
    return hit[1]


def _descriptor(t: torch.Tensor, block: list, dtype_bits: int, swizzle: int = 0):
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=dtype_bits, rank=len(block))
    return TensorDescriptor.from_tensor(t, block, layout)


def grouped_ws(act, weights, scales_t, order, blocks, out, block_m: int, tw=None, limit: float = 0.0, topk: int = 1,
               block_n: int = 64, block_k: int = 64, group_m: int = 4, stages: int = 4, bf16_acts: bool = True,
               decode_regs: int = 96, decoders: int = 1, maxnreg: int | None = None, persistent: int = 0):
    """One grouped FP4 GEMM of the MoE over moe_align's token blocks `blocks` (expert, first, end), act [P, K] bf16
    (rows in expert order: the pairs' activation, on the E4M3 grid, NIB order along K). Two weights (W1, W3:
    packed FP4 [E * I, dim / 2], int8/uint8): the gate/up GEMM, out = h [P, I] the engine's hidden state (tw [P]
    float32 the routing weights by pair id, limit the SwiGLU clamp). One weight (W2 [E * dim, I / 2]): the down
    GEMM, out [T, dim] float32 += each pair's output (topk: pairs a token). scales_t: `transposed_scales` of each.
    decoders: decoding warp groups (alternate K steps), decode_regs their registers; maxnreg: the launch's register
    count a thread (the partitions share 12 or 16 warps' worth: at most 85 a thread for two programs an SM);
    persistent: that many programs an SM, each looping over tiles (the loads and decodes of its next tile under
    this one's epilogue), instead of a program a tile (0)."""
    if not HAVE_GLUON:
        raise RuntimeError("the warp-specialized MoE form needs triton.experimental.gluon (triton >= 3.6)")
    p, kdim = act.shape
    nw = len(weights)
    n_rows = weights[0].shape[0] // (scales_t[0].shape[0] // (kdim // 32))  # rows an expert
    if n_rows % block_n or kdim % block_k or block_k % 32 or nw not in (1, 2):
        raise ValueError(f"rows an expert {n_rows} must divide by block_n {block_n}, K {kdim} by block_k {block_k} "
                         "(a multiple of 32), and the weights be one (down) or two (gate/up)")
    words = [w.contiguous().view(torch.int32) for w in weights]  # [E * N, K / 8]: a stage: BN rows of BK/2 bytes
    a_desc = _descriptor(act, [block_m, block_k], 16, 128)
    w_descs = [_descriptor(w, [block_n, block_k // 8], 32) for w in words]
    s_descs = [_descriptor(s, [block_k // 32, block_n], 8) for s in scales_t]
    bexp, bbeg, bend = blocks
    nbm = bexp.numel()
    n_tiles = nbm * (n_rows // block_n)
    programs = min(n_tiles, persistent * sm_count(act.device)) if persistent else n_tiles
    _moe_ws_kernel[(programs,)](
        a_desc, w_descs[0], w_descs[-1], s_descs[0], s_descs[-1], order, bexp, bbeg, bend, out,
        tw if tw is not None else out, float(limit), nbm, K=kdim, N=n_rows, TOPK=topk, NW=nw, BM=block_m, BN=block_n,
        BK=block_k, GROUP_M=group_m, STAGES=stages, RB=bf16_acts, DECODE_REGS=decode_regs, DECODERS=decoders,
        num_warps=4, **register_cap(maxnreg))
    return out


__all__ = ["HAVE_GLUON", "cached_transposed_scales", "gluon_fits", "grouped_ws", "runs_on", "transposed_scales"]
