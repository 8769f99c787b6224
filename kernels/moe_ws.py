"""The prefill's expert gate/up GEMM with its FP4 decode in warps of their own (Gluon, Hopper; GPU only).

Why: in the Triton kernel (kernels/moe.py) the same warps decode each FP4 tile and feed it to the MMA, so a
tile's decode and its MMA never overlap (register operand), and a decoded tile stored for the MMA costs a
proxy fence that stalls the pipeline's loads (the "halves" form of run 35a). Here three partitions of one
program share a ring of shared-memory stages:
- loader (1 warp): TMA copies of a stage's raw FP4 words, their E8M0 bytes (a transposed copy, so a
  stage's bytes are one box) and the activation rows (gathered once into expert order, so a token block
  is one box);
- decoder (4 warps): the words to bf16 pairs with the scale folded in (kernels/_formats.e2m1_pairs_ptx,
  the same bits as fp4_tiles.fp4_decoded_folded), stored in the MMA's shared layout, then one proxy fence
  and an arrive: the fence waits on nothing but the decoder's own shared-memory stores;
- MMA (4 warps, the default partition): asynchronous wgmma on W1's and W3's decoded tiles against the
  activation tile, one stage in flight, then the epilogue of kernels/moe.py (`swiglu_e4m3_values`) and h
  stored in expert order, NIB order along I, as the down kernel reads it.
The values are the Triton kernel's (the same bf16 products, float32 sums in the MMA's K order). Gluon has
no interpreter: tests/test_moe_ws_gpu.py checks it on a GPU, tests/test_kernels_compile_sm90.py compiles it.
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
from kernels._formats import e2m1_pairs_ptx
from kernels.fp4_tiles import FOLD_FACTOR_OFFSET, FOLD_MAX_SCALE_BYTE

# one int32 word (8 nibbles) -> its four NIB-ordered bf16 pairs times the factor in $5 (= $6: one 32-group)
_PAIRS_PTX = "{\n.reg .b32 m, s;\n" + e2m1_pairs_ptx("$4") + "}\n"

if HAVE_GLUON:
    _PAIRS_ASM = gl.constexpr(_PAIRS_PTX)
    _FOLD_OFFSET = gl.constexpr(FOLD_FACTOR_OFFSET)
    _FOLD_MAX = gl.constexpr(FOLD_MAX_SCALE_BYTE)

    @gluon.jit
    def _loader(x_desc, w1_desc, w3_desc, s1_desc, s3_desc, xs, w1r, w3r, s1r, s3r, w1d, w3d, bars, e, nb, r0, KSTEPS,
                INTER):
        raw_ready, raw_empty, mma_ready, mma_empty = bars
        STAGES: gl.constexpr = xs.shape[0]
        BK: gl.constexpr = xs.shape[2]
        BN: gl.constexpr = w1d.shape[1]
        wrow = e * INTER + nb * BN
        srow = e * KSTEPS * (BK // 32)
        for i in range(KSTEPS):
            s = i % STAGES
            ph = (i // STAGES) & 1
            mbarrier.wait(raw_empty.index(s), ph ^ 1)
            fence_async_shared()  # the decoder's reads of this stage before the copy's writes
            mbarrier.expect(raw_ready.index(s), 2 * w1_desc.block_type.nbytes + 2 * s1_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w1_desc, [wrow, i * (BK // 32), 0], raw_ready.index(s), w1r.index(s))
            tma.async_copy_global_to_shared(w3_desc, [wrow, i * (BK // 32), 0], raw_ready.index(s), w3r.index(s))
            tma.async_copy_global_to_shared(s1_desc, [srow + i * (BK // 32), nb * BN], raw_ready.index(s),
                                            s1r.index(s))
            tma.async_copy_global_to_shared(s3_desc, [srow + i * (BK // 32), nb * BN], raw_ready.index(s),
                                            s3r.index(s))
            mbarrier.wait(mma_empty.index(s), ph ^ 1)
            mbarrier.expect(mma_ready.index(s), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [r0, i * BK], mma_ready.index(s), xs.index(s))

    @triton.constexpr_function
    def _words_layout(groups):
        groups = getattr(groups, "value", groups)
        return gl.BlockedLayout([1, 1, 4], [32 // groups, groups, 1], [4, 1, 1], [2, 1, 0])

    @gluon.jit
    def _decoded(words, sbytes):
        """Words [BN, BK/32, 4] int32 and their group's E8M0 bytes [BN, BK/32, 1] -> [BN, BK/2] int32 bf16 pairs
        (NIB order), the scale folded in as fp4_tiles.fp4_decoded_folded does (NaN past FOLD_MAX_SCALE_BYTE)."""
        b = sbytes.to(gl.int32)
        f = gl.where(b <= _FOLD_MAX, (b + _FOLD_OFFSET) << 7, 0x7FC0)
        f = f | (f << 16)
        f, words = gl.broadcast(f, words)
        p0, p1, p2, p3 = gl.inline_asm_elementwise(_PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [words, f, f],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)
        pairs = gl.join(gl.join(p0, p1), gl.join(p2, p3))
        return gl.reshape(pairs, [words.shape[0], words.shape[1] * 16])

    @gluon.jit
    def _decoder(x_desc, w1_desc, w3_desc, s1_desc, s3_desc, xs, w1r, w3r, s1r, s3r, w1d, w3d, bars, e, nb, r0, KSTEPS,
                 INTER):
        raw_ready, raw_empty, mma_ready, mma_empty = bars
        STAGES: gl.constexpr = xs.shape[0]
        BK: gl.constexpr = xs.shape[2]
        BN: gl.constexpr = w1d.shape[1]
        G: gl.constexpr = w1r.shape[2]
        # a thread: one 32-group of one row (four words, 16 bytes)
        words_layout: gl.constexpr = _words_layout(G)
        bytes_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
        pairs_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        for i in range(KSTEPS):
            s = i % STAGES
            ph = (i // STAGES) & 1
            mbarrier.wait(raw_ready.index(s), ph)
            w1 = w1r.index(s).load(words_layout)
            w3 = w3r.index(s).load(words_layout)
            b1 = gl.expand_dims(s1r.index(s).permute((1, 0)).load(bytes_layout), 2)
            b3 = gl.expand_dims(s3r.index(s).permute((1, 0)).load(bytes_layout), 2)
            mbarrier.arrive(raw_empty.index(s))
            p1 = _decoded(w1, b1)
            p3 = _decoded(w3, b3)
            mbarrier.wait(mma_empty.index(s), ph ^ 1)
            w1d.index(s)._reinterpret(gl.int32, [BN, BK // 2], pairs_layout).store(p1)
            w3d.index(s)._reinterpret(gl.int32, [BN, BK // 2], pairs_layout).store(p3)
            fence_async_shared()  # the stores before the MMA's (async proxy) reads
            mbarrier.arrive(mma_ready.index(s))

    @gluon.jit
    def _mma(xs, w1d, w3d, bars, h_ptr, tw_ptr, order_ptr, limit, nb, r0, r1,
             KSTEPS: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, RB: gl.constexpr):
        raw_ready, raw_empty, mma_ready, mma_empty = bars
        STAGES: gl.constexpr = xs.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        acc1 = gl.zeros([BN, BM], gl.float32, acc_layout)
        acc3 = gl.zeros([BN, BM], gl.float32, acc_layout)
        for i in range(KSTEPS):
            s = i % STAGES
            mbarrier.wait(mma_ready.index(s), (i // STAGES) & 1)
            xt = xs.index(s).permute((1, 0))  # [BK, BM], K-major
            acc1 = warpgroup_mma(w1d.index(s), xt, acc1, is_async=True)
            acc3 = warpgroup_mma(w3d.index(s), xt, acc3, is_async=True)
            acc1, acc3 = warpgroup_mma_wait(num_outstanding=2, deps=(acc1, acc3))
            mbarrier.arrive(mma_empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        acc1, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, acc3))
        rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
        rmask = rows < r1
        pair = gl.load(order_ptr + rows, mask=rmask, other=0)
        n_idx = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
        h = moe_f8.swiglu_e4m3_values(acc1, acc3, gl.load(tw_ptr + pair, mask=rmask, other=0.0), limit, BN, BM, RB)
        h = gl.convert_layout(h, acc_layout)  # the reshapes' layout is this one, by another name
        col = (n_idx & -8) | ((n_idx & 3) << 1) | ((n_idx >> 2) & 1)  # fp4_tiles.nib_position
        gl.store(h_ptr + gl.expand_dims(rows, 0).to(gl.int64) * INTER + gl.expand_dims(col, 1),
                 h.to(h_ptr.dtype.element_ty), mask=gl.expand_dims(rmask, 0) & gl.expand_dims(n_idx < INTER, 1))

    @gluon.jit
    def _moe_gate_up_ws_kernel(x_desc, w1_desc, w3_desc, s1_desc, s3_desc, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr,
                               h_ptr, tw_ptr, limit, NBM, DIM: gl.constexpr, INTER: gl.constexpr,
                               BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                               STAGES: gl.constexpr, RB: gl.constexpr, DECODE_REGS: gl.constexpr):
        pid = gl.program_id(0)
        NBN: gl.constexpr = INTER // BN
        per_group = GROUP_M * NBN
        first = (pid // per_group) * GROUP_M
        size = gl.minimum(NBM - first, GROUP_M)
        mb = first + (pid % per_group) % size
        nb = (pid % per_group) // size
        e = gl.load(bexp_ptr + mb)
        if e >= 0:
            r0 = gl.load(bbeg_ptr + mb)
            r1 = gl.load(bend_ptr + mb)
            G: gl.constexpr = BK // 32
            xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_desc.layout)
            w1r = gl.allocate_shared_memory(gl.int32, [STAGES, BN, G, 4], w1_desc.layout)
            w3r = gl.allocate_shared_memory(gl.int32, [STAGES, BN, G, 4], w3_desc.layout)
            s1r = gl.allocate_shared_memory(gl.uint8, [STAGES, G, BN], s1_desc.layout)
            s3r = gl.allocate_shared_memory(gl.uint8, [STAGES, G, BN], s3_desc.layout)
            dec_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            w1d = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], dec_layout)
            w3d = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], dec_layout)
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
            KSTEPS: gl.constexpr = DIM // BK
            worker = (x_desc, w1_desc, w3_desc, s1_desc, s3_desc, xs, w1r, w3r, s1r, s3r, w1d, w3d, bars, e, nb, r0,
                      KSTEPS, INTER)
            gl.warp_specialize([
                (_mma, (xs, w1d, w3d, bars, h_ptr, tw_ptr, order_ptr, limit, nb, r0, r1, KSTEPS, INTER, BN, BM, RB)),
                (_loader, worker),
                (_decoder, worker),
            ], [1, 4], [40, DECODE_REGS])


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


def gate_up_ws(x_sorted, w1, s1t, w3, s3t, order, blocks, tw, h, limit: float, block_m: int, block_n: int = 64,
               block_k: int = 64, group_m: int = 4, stages: int = 4, bf16_acts: bool = True, decode_regs: int = 96):
    """h[P, I] (expert order, NIB order along I) = the engine's hidden state for the token blocks `blocks` (moe_align's
    (expert, first, end)): x_sorted [P, dim] bf16 (the pairs' activation rows in expert order, on the E4M3 grid,
    NIB order), w1/w3 packed FP4 [E * I, dim / 2] (int8/uint8), s1t/s3t `transposed_scales`, tw [P] float32 (the
    pairs' routing weights by pair id), order (moe_align's)."""
    if not HAVE_GLUON:
        raise RuntimeError("the warp-specialized MoE form needs triton.experimental.gluon (triton >= 3.6)")
    p, dim = x_sorted.shape
    inter = h.shape[1]
    if inter % block_n or dim % block_k or block_k % 32:
        raise ValueError(f"I {inter} must divide by block_n {block_n}, dim {dim} by block_k {block_k} (a multiple "
                         "of 32)")
    words = [w.contiguous().view(torch.int32).view(w.shape[0], dim // 32, 4) for w in (w1, w3)]
    x_desc = _descriptor(x_sorted, [block_m, block_k], 16, 128)
    w1_desc, w3_desc = (_descriptor(w, [block_n, block_k // 32, 4], 32) for w in words)
    s1_desc, s3_desc = (_descriptor(s, [block_k // 32, block_n], 8) for s in (s1t, s3t))
    bexp, bbeg, bend = blocks
    nbm = bexp.numel()
    _moe_gate_up_ws_kernel[(nbm * (inter // block_n),)](
        x_desc, w1_desc, w3_desc, s1_desc, s3_desc, order, bexp, bbeg, bend, h, tw, float(limit), nbm, DIM=dim,
        INTER=inter, BM=block_m, BN=block_n, BK=block_k, GROUP_M=group_m, STAGES=stages, RB=bf16_acts,
        DECODE_REGS=decode_regs, num_warps=4)
    return h


__all__ = ["HAVE_GLUON", "cached_transposed_scales", "gate_up_ws", "transposed_scales"]
