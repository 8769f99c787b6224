"""FP4 (E2M1) weight tiles with E8M0 scales per 32, decoded in registers for the MoE kernels (kernels/moe.py).

Bit assembly: an int32 word holds 8 nibbles; for A = 0..3 one shift-and-mask pair builds two 16-bit
patterns at once (nibble A in the low half, nibble A+4 in the high half):
- fp16 form: half = (n & 7) << 9 | (n & 8) << 12 -> fp16 value = E2M1 value * 2^-14 exactly (the E2M1
  subnormal 0.5 lands on an fp16 subnormal, which fp16 hardware never flushes); the fp16 -> fp32
  convert is exact and the E8M0 scale (times 2^14) one fp32 multiply.
- bf16 form (tensor-core tiles): the 3 magnitude bits on bf16's low exponent bits and top mantissa bit
  -> E2M1 value * 2^-126 exactly; times 2^126 and the scale as two exact bf16 multiplies (one multiply
  by 2^126 x the scale, exact for scales <= 2, was 30 SASS instructions more per K step: packing each
  per-word scale into bf16 pairs costs more than the multiply it saves).
Scale bytes are loaded once per 32-group and widened in registers (a load per word made 4x the L1
requests). Tiles come out with K in NIB order inside each 8-group: position 2 A + half holds nibble
A + 4 half, so the two halves of a pattern are neighbours (a bf16 pair is the pattern itself; the
order (0, 2, 1, 3, 4, 6, 5, 7) before cost 32 byte permutes per 64-wide K step of the MoE's gate/up
kernel: 389 -> 355 SASS instructions in its loop, sm_90). `nib_order` permutes an activation the same
way. MMA order (`a_layout="mma"` in kernels/moe.py): on top of NIB, each 64 block of K is relabelled
as kernels/_formats.py's `mma_k_position` says (NIB column 16 c + 4 s + 2 h + t goes to 16 s + 8 h +
2 c + t), so that lane c of a quad, whose Hopper wgmma register A fragment holds K columns
2 c + {0, 1, 8, 9} of each 16, holds exactly NIB columns 16 c .. 16 c + 15: its own two int32 words, each
bf16 pair of the fragment one `nibble_pair_bf16` result. With the words loaded where the fragment wants
them (`fp4_words_mma`), the decoded tile feeds the wgmma from the registers it was decoded in, without
the shared-memory round trip (sm_90 SASS, gate/up loop at the decode step's tiles: 8 STS + 8 LDSM per
step -> none, 355 -> 333 instructions). The stored weights are untouched (`in_mma_k_order` relabels
registers); x and h take the combined order (`mma_order`, `mma_position`). `fp4_dot_scaled` is the
other route: the raw bytes into Triton's own MXFP4 upcast (tl.dot_scaled; GPU only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import in_mma_k_order, mma_k_position


@triton.jit
def nibble_pair(wd, A: tl.constexpr):
    """int32 words -> (nibble A, nibble A+4) of each word as float32 E2M1 value * 2^-14 (exact)."""
    if A == 3:
        mag = (wd >> 3) & 0x0E000E00
    else:
        mag = (wd << (9 - 4 * A)) & 0x0E000E00
    # -2147450880 = 0x80008000 as an int32: the two sign bits
    bits = mag | ((wd << (12 - 4 * A)) & -2147450880)
    lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def scale_bytes(s_ptr, row_off, kw0, W: tl.constexpr, mask):
    """E8M0 bytes of words kw0 .. kw0 + W - 1 (kw0 and W multiples of 4: 4 words share a 32-group's
    byte) as int32 [R, W]: one load per byte, widened in registers (a load per word made 4x the L1
    requests: ncu, the 64-token decode step, L1 92.9% busy, 77% of global sectors excess)."""
    g = kw0 // 4 + tl.arange(0, W // 4)
    byte = tl.load(s_ptr + row_off[:, None] + g[None, :], mask=mask, other=127).to(tl.int32)
    return tl.reshape(tl.broadcast_to(byte[:, :, None], (row_off.shape[0], W // 4, 4)), (row_off.shape[0], W))


@triton.jit
def scale_of(byte, BD: tl.constexpr):
    """E8M0 bytes (int32) as the decode's multiplier: BD, bf16 2^(byte - 127) (byte 0 is 2^-127: the bf16
    subnormal 0x0040); else float32 2^(byte - 127) * 2^14 straight from the exponent bits (normal for every
    byte up to 240)."""
    if BD:
        return tl.where(byte == 0, 0x40, byte << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return ((byte + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_words(s_ptr, row_off, kw0, W: tl.constexpr, mask):
    """E8M0 scale of words kw0 .. kw0 + W - 1 times 2^14, float32 [R, W]."""
    return scale_of(scale_bytes(s_ptr, row_off, kw0, W, mask), False)


@triton.jit
def nibble_pair_bf16(wd, A: tl.constexpr):
    """int32 words -> (nibble A, nibble A+4) of each word as bf16 E2M1 value * 2^-126 (exact): the
    3 magnitude bits land on the exponent's low 2 bits and the mantissa's top bit (E2M1's 0.5 on the
    bf16 subnormal 2^-127)."""
    if A < 2:
        mag = (wd << (6 - 4 * A)) & 0x01C001C0
    else:
        mag = (wd >> (4 * A - 6)) & 0x01C001C0
    bits = mag | ((wd << (12 - 4 * A)) & -2147450880)  # the two sign bits, as in nibble_pair
    lo = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def fp4_words(w_ptr, s_ptr, rows, rmask, k0, KDIM: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """The raw words [BR, BK/8] of a [BR, BK] tile of an FP4 weight [N, KDIM] and their scales per word
    (BD: bf16 2^(byte - 127), else float32 times 2^14): apart from the decode, so that a kernel issues
    several tiles' loads before any decode (the gate/up kernel: W1's and W3's; 243 registers at the
    release's prefill tiles, 252 when each tile is loaded and decoded in turn)."""
    KW: tl.constexpr = KDIM // 8
    kw = k0 // 8 + tl.arange(0, BK // 8)
    r64 = rows.to(tl.int64)
    wd = tl.load(w_ptr + r64[:, None] * KW + kw[None, :], mask=rmask[:, None], other=0)
    return wd, scale_of(scale_bytes(s_ptr, r64 * (KDIM // 32), k0 // 8, BK // 8, rmask[:, None]), BD)


@triton.jit
def fp4_words_mma(w_ptr, s_ptr, row0, nrows, k0, KDIM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                  BD: tl.constexpr):
    """`fp4_words` for the MMA order: the words and scales of weight rows row0 .. row0 + BR - 1 (those below
    nrows of them; row0 an int64 row of the [N, KDIM] weight), loaded so that each thread holds exactly the
    words its wgmma A fragment needs. The load is shaped [BK/64, 2, BR/64, 4, 8, 4, 2] = (K block kb, row bit
    h, 64-row block m, warp w, lane row g, lane column c, word j): tile row 64 m + 16 w + 8 h + g, word
    8 kb + 2 c + j. With the last dimension the contiguous one, Triton's coalescing gives j to registers (an
    8-byte load), c and g to the 32 lanes, w to the 4 warps (m too at 8 warps) and the rest to registers:
    the wgmma's own distribution (lane 4 g + c, warp w, rows g and g + 8 of its 16), which the permute and
    reshape below only relabel (the decode's joins and `in_mma_k_order` then stay in registers). The plain
    [BR, BK/8] load (16-byte vectors, 2 lanes a row) left a warp-shuffle exchange of the decoded tile."""
    KW: tl.constexpr = KDIM // 8
    KB: tl.constexpr = BK // 64
    M: tl.constexpr = BR // 64
    kb = tl.arange(0, KB)[:, None, None, None, None, None]
    h = tl.arange(0, 2)[None, :, None, None, None, None]
    m = tl.arange(0, M)[None, None, :, None, None, None]
    w = tl.arange(0, 4)[None, None, None, :, None, None]
    g = tl.arange(0, 8)[None, None, None, None, :, None]
    c = tl.arange(0, 4)[None, None, None, None, None, :]
    r = 64 * m + 16 * w + 8 * h + g  # [1, 2, M, 4, 8, 1]
    rmask = r < nrows
    r64 = row0 + r.to(tl.int64)
    kw = k0 // 8 + 8 * kb + 2 * c  # [KB, 1, 1, 1, 1, 4]
    j = tl.arange(0, 2)[None, None, None, None, None, None, :]
    wd = tl.load(w_ptr + (r64 * KW + kw)[:, :, :, :, :, :, None] + j, mask=rmask[:, :, :, :, :, :, None],
                 other=0)
    byte = tl.load(s_ptr + r64 * (KDIM // 32) + kw // 4, mask=rmask, other=127).to(tl.int32)
    sc = scale_of(byte, BD)
    sc = tl.broadcast_to(sc[:, :, :, :, :, :, None], (KB, 2, M, 4, 8, 4, 2))
    # [kb, h, m, w, g, c, j] -> [m, w, h, g, kb, c, j] -> [BR, BK/8]
    wd = tl.reshape(tl.permute(wd, (2, 3, 1, 4, 0, 5, 6)), (BR, BK // 8))
    sc = tl.reshape(tl.permute(sc, (2, 3, 1, 4, 0, 5, 6)), (BR, BK // 8))
    return wd, sc


@triton.jit
def fp4_decoded(wd, sc, BK: tl.constexpr, DT: tl.constexpr, BD: tl.constexpr, MMA: tl.constexpr = False):
    """Words and scales from `fp4_words` (or `fp4_words_mma`) -> the [BR, BK] tile in DT, K in NIB order
    within each 8-group (see the module docstring); MMA: in MMA order (BK a multiple of 64). The nibble
    pairs are placed first, then the whole tile is scaled: a word's two halves (nibbles A and A+4) are
    neighbours in NIB order, so in bf16 a pair is the word's own bits and its scaling one bf16x2 multiply,
    with no repacking between them."""
    if BD:
        a0, b0 = nibble_pair_bf16(wd, 0)
        a1, b1 = nibble_pair_bf16(wd, 1)
        a2, b2 = nibble_pair_bf16(wd, 2)
        a3, b3 = nibble_pair_bf16(wd, 3)
    else:
        a0, b0 = nibble_pair(wd, 0)
        a1, b1 = nibble_pair(wd, 1)
        a2, b2 = nibble_pair(wd, 2)
        a3, b3 = nibble_pair(wd, 3)
    # [BR, BK/8, A >> 1, A & 1, half] -> position 2 A + half: nibble A + 4 half
    t = tl.join(tl.join(tl.join(a0, a2), tl.join(a1, a3)), tl.join(tl.join(b0, b2), tl.join(b1, b3)))
    t = tl.reshape(t, (wd.shape[0], BK))
    s = tl.reshape(tl.broadcast_to(sc[:, :, None], (wd.shape[0], BK // 8, 8)), (wd.shape[0], BK))
    if BD:  # two exact bf16 multiplies by powers of two: 2^126 makes the E2M1 value, then the scale
        two126 = tl.full(t.shape, 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)  # 2^126, from its bits
        t = (t * two126 * s).to(DT)
    else:
        t = (t * s).to(DT)
    if MMA:
        t = in_mma_k_order(t, BK)
    return t


@triton.jit
def fp4_tile(w_ptr, s_ptr, rows, rmask, k0, KDIM: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
             BD: tl.constexpr, MMA: tl.constexpr = False):
    """[BR, BK] tile of an FP4 weight [N, KDIM] (int32 words, 8 nibbles each) decoded to DT, K in NIB
    order within each 8-group (MMA: in MMA order); BD: through bf16 bits (DT bf16)."""
    wd, sc = fp4_words(w_ptr, s_ptr, rows, rmask, k0, KDIM, BK, BD)
    return fp4_decoded(wd, sc, BK, DT, BD, MMA)


@triton.jit
def _decode_tile_kernel(w_ptr, s_ptr, out_ptr, R: tl.constexpr, KDIM: tl.constexpr, BD: tl.constexpr,
                        BK: tl.constexpr, MMA: tl.constexpr):
    rows = tl.arange(0, R)
    for k0 in tl.static_range(0, KDIM, BK):
        if MMA:  # as the MoE's a_layout "mma" loads and decodes it
            wd, sc = fp4_words_mma(w_ptr, s_ptr, 0, R, k0, KDIM, R, BK, BD)
            tile = fp4_decoded(wd, sc, BK, tl.bfloat16 if BD else tl.float32, BD, True)
        else:
            tile = fp4_tile(w_ptr, s_ptr, rows, rows < R, k0, KDIM, BK, tl.bfloat16 if BD else tl.float32, BD)
        tile = tile.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * KDIM + k0 + tl.arange(0, BK)[None, :], tile)


def fp4_tile_decoded(packed: torch.Tensor, scale: torch.Tensor, bf16_decode: bool, mma: bool = False,
                     block_k: int | None = None) -> torch.Tensor:
    """The grouped GEMM's tile decode alone, for checks: packed int8 [R, K/2] (R, K powers of two) and
    E8M0 bytes [R, K/32] -> float32 [R, K] in NIB order (mma: MMA order, through `fp4_words_mma`; R and
    block_k multiples of 64), block_k (default K) of K per decode. bf16_decode needs a GPU: the interpreter
    does not emulate bf16 bit casts (its values come out 0)."""
    r, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(r, k, dtype=torch.float32, device=packed.device)
    _decode_tile_kernel[(1,)](packed.contiguous().view(torch.int32), scale.contiguous().view(torch.uint8), out,
                              R=r, KDIM=k, BD=bool(bf16_decode), BK=block_k or k, MMA=bool(mma))
    return out


@triton.jit
def nib_position(n):
    """Column of original K index n (nibble A + 4 half of its word) in NIB order: 2 A + half."""
    return (n & -8) | ((n & 3) << 1) | ((n >> 2) & 1)


@triton.jit
def mma_position(n):
    """Column of original K index n in MMA order: NIB, then the `in_mma_k_order` relabelling of its 64 block."""
    m = nib_position(n)
    return (m & -64) | mma_k_position(m & 63)


@triton.jit
def fp4_dot_scaled(wb_ptr, s_ptr, rows, rmask, k0, b_tile, acc, KDIM: tl.constexpr, BK: tl.constexpr):
    """acc + W[rows, k0:k0+BK] @ b_tile through tl.dot_scaled: the weight's raw FP4 bytes (wb_ptr: uint8
    [N, KDIM/2], low nibble first, as e2m1 packs) with its E8M0 bytes, Triton's own MXFP4 upcast (K in
    natural order). GPU only: the interpreter has no dot_scaled."""
    r64 = rows.to(tl.int64)
    kb = k0 // 2 + tl.arange(0, BK // 2)
    ks = k0 // 32 + tl.arange(0, BK // 32)
    wb = tl.load(wb_ptr + r64[:, None] * (KDIM // 2) + kb[None, :], mask=rmask[:, None], other=0)
    sb = tl.load(s_ptr + r64[:, None] * (KDIM // 32) + ks[None, :], mask=rmask[:, None], other=127)
    return tl.dot_scaled(wb, sb, "e2m1", b_tile, None, "bf16", acc)


def nib_order(a: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K] with K in NIB order inside each 8-group: position 2 A + half holds index A + 4 half."""
    r, kdim = a.shape
    return a.reshape(r, kdim // 8, 2, 4).transpose(-1, -2).reshape(r, kdim)


def mma_order(a: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K] in MMA order (K a multiple of 64): `nib_order`, then each 64 block's NIB column
    16 c + 4 s + 2 h + t at 16 s + 8 h + 2 c + t (`in_mma_k_order`, `mma_position`)."""
    r, kdim = a.shape
    t = nib_order(a).reshape(r, kdim // 64, 4, 4, 2, 2)
    return t.permute(0, 1, 3, 4, 2, 5).reshape(r, kdim)
