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
way. `fp4_dot_scaled` is the other route: the raw bytes into Triton's own MXFP4 upcast (tl.dot_scaled;
GPU only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import e2m1_pairs_ptx, e8m0_bf16_factor, e8m0_bytes_at_most


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


# E2M1 words -> NIB-ordered bf16 pairs times a factor, one word ($4) a call (_formats.e2m1_pairs_ptx): pair A =
# (nibble A, nibble A + 4), 16 bits apart in the word as stored. $0 $1: pairs 0 and 1 (positions 0-3 of the
# word's NIB order), $2 $3: pairs 2 and 3 (positions 4-7); factors in $5 $6.
E2M1_NIB_BF16_PTX = "{\n.reg .b32 m, s;\n" + e2m1_pairs_ptx("$4") + "}\n"
_E2M1_NIB_BF16_ASM = tl.constexpr(E2M1_NIB_BF16_PTX)
# the folded factor 2^(s - 1) (_formats.e8m0_bf16_factor at offset 126) is a finite bf16 up to s = 128 (a scale
# of 2; the release's expert scales sit near 2^-10)
FOLD_FACTOR_OFFSET = 126
FOLD_MAX_SCALE_BYTE = 254 - FOLD_FACTOR_OFFSET
_FOLD_FACTOR_OFFSET = tl.constexpr(FOLD_FACTOR_OFFSET)


@triton.jit
def fp4_bytes_folded(w_ptr, s_ptr, rows, rmask, k0, KDIM: tl.constexpr, BK: tl.constexpr):
    """The fold form's loads: the tile's bytes [BR, BK/8, 4] (uint8, a word's four in a row) and its factors
    2^(s - 1) per byte, bf16 (E8M0 s times the 2^126 the placement leaves out; NaN past FOLD_MAX_SCALE_BYTE)."""
    r64 = rows.to(tl.int64)
    BR: tl.constexpr = rows.shape[0]
    kb = k0 // 2 + tl.arange(0, BK // 2)
    b = tl.load(w_ptr.to(tl.pointer_type(tl.uint8)) + r64[:, None] * (KDIM // 2) + kb[None, :], mask=rmask[:, None],
                other=0)
    byte = scale_bytes(s_ptr, r64 * (KDIM // 32), k0 // 8, BK // 8, rmask[:, None])  # [BR, BK/8], per word
    f = e8m0_bf16_factor(byte, _FOLD_FACTOR_OFFSET)
    return tl.reshape(b, (BR, BK // 8, 4)), tl.broadcast_to(f[:, :, None], (BR, BK // 8, 4))


@triton.jit
def fp4_decoded_folded(b, f, BK: tl.constexpr):
    """fp4_bytes_folded's tiles -> the [BR, BK] bf16 tile in NIB order (E2M1_NIB_BF16_PTX; GPU only): the
    scale folded into the pairs' one multiply, where the bf16 form takes two (2^126, then the scale). sm_90
    SASS (triton 3.6, benches/compile_sm90.py --sass): the gate/up loop 621 instructions a 64-wide K step
    at the prefill's 64 x 128 tiles (bf16 form 690), 336 at the decode step's 16 x 64 (368)."""
    lo, hi = tl.inline_asm_elementwise(_E2M1_NIB_BF16_ASM, "=r,=r,=r,=r,r,r,r", [b, f],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    BR: tl.constexpr = b.shape[0]
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BR, BK))


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
def fp4_decoded(wd, sc, BK: tl.constexpr, DT: tl.constexpr, BD: tl.constexpr):
    """Words and scales from `fp4_words` -> the [BR, BK] tile in DT, K in NIB order within each
    8-group (see the module docstring). The nibble pairs are placed first, then the whole tile is
    scaled: a word's two halves (nibbles A and A+4) are neighbours in NIB order, so in bf16 a pair is the
    word's own bits and its scaling one bf16x2 multiply, with no repacking between them."""
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
        return (t * two126 * s).to(DT)
    return (t * s).to(DT)


@triton.jit
def fp4_tile(w_ptr, s_ptr, rows, rmask, k0, KDIM: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
             BD: tl.constexpr):
    """[BR, BK] tile of an FP4 weight [N, KDIM] (int32 words, 8 nibbles each) decoded to DT, K in NIB
    order within each 8-group; BD: through bf16 bits (DT bf16)."""
    wd, sc = fp4_words(w_ptr, s_ptr, rows, rmask, k0, KDIM, BK, BD)
    return fp4_decoded(wd, sc, BK, DT, BD)


@triton.jit
def _decode_tile_kernel(w_ptr, s_ptr, out_ptr, R: tl.constexpr, KDIM: tl.constexpr, BD: tl.constexpr):
    rows = tl.arange(0, R)
    if BD == 2:
        b, f = fp4_bytes_folded(w_ptr, s_ptr, rows, rows < R, 0, KDIM, KDIM)
        tile = fp4_decoded_folded(b, f, KDIM)
    else:
        tile = fp4_tile(w_ptr, s_ptr, rows, rows < R, 0, KDIM, KDIM, tl.bfloat16 if BD else tl.float32, BD)
    tile = tile.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * KDIM + tl.arange(0, KDIM)[None, :], tile)


def decode_form(bf16_decode) -> int:
    """The kernels' BD constant for a `bf16_decode` argument: 0 float32, 1 bf16 bits, 2 the folded bf16 form."""
    if bf16_decode not in (False, True, "fold"):
        raise ValueError(f"bf16_decode must be False, True or 'fold', got {bf16_decode!r}")
    return 2 if bf16_decode == "fold" else int(bf16_decode)


def fold_fits(*scales: torch.Tensor) -> bool:
    """Whether every E8M0 scale byte is in the folded form's range (its factor 2^(s - 1) a finite bf16: scales
    up to 2); a device read (call once per weight). A byte past it gives NaN, not a wrong value."""
    return e8m0_bytes_at_most(FOLD_MAX_SCALE_BYTE, *scales)


def fp4_tile_decoded(packed: torch.Tensor, scale: torch.Tensor, bf16_decode) -> torch.Tensor:
    """The grouped GEMM's tile decode alone, for checks: packed int8 [R, K/2] (R, K powers of two) and
    E8M0 bytes [R, K/32] -> float32 [R, K] in NIB order. bf16_decode (decode_form) True or "fold" needs a
    GPU: the interpreter does not emulate bf16 bit casts (its values come out 0) or run PTX."""
    r, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(r, k, dtype=torch.float32, device=packed.device)
    _decode_tile_kernel[(1,)](packed.contiguous().view(torch.int32), scale.contiguous().view(torch.uint8), out,
                              R=r, KDIM=k, BD=decode_form(bf16_decode))
    return out


@triton.jit
def nib_position(n):
    """Column of original K index n (nibble A + 4 half of its word) in NIB order: 2 A + half."""
    return (n & -8) | ((n & 3) << 1) | ((n >> 2) & 1)


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
