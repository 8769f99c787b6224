"""Triton device helpers for the release's number formats (bit-exact with engine/quant.py).

All decoders work on raw bytes (uint8/int32 lanes) with integer arithmetic and bit casts, so the same
code runs on the GPU and under TRITON_INTERPRET=1. One native cast is relied on where compiled: float32 to
bf16, which rounds to nearest even on the GPU (`cast_rne`; the interpreter's does not, so it takes bit
arithmetic there).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def fp4_value(code):
    """4-bit E2M1 codes (int32 lanes, bit 3 = sign) -> float32 values in {0, .5, ..., 6} with sign."""
    mag = code & 7
    # magnitude codes >= 2 are normal: 2^((m >> 1) - 1) * (1 + (m & 1) / 2)
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    val = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def e8m0_value(byte):
    """E8M0 bytes (int32 lanes) -> float32 2^(byte - 127); byte 0 is 2^-127 (a float32 subnormal)."""
    return tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(byte):
    """E4M3 (fn) bytes (int32 lanes) -> float32 values, exact."""
    exp = (byte >> 3) & 15
    man = byte & 7
    normal = ((exp + 120) << 23) | (man << 20)
    val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    return tl.where((byte & 0x80) != 0, -val, val)


# E2M1 -> E4M3 bit placement, four packed bytes (eight codes) per 32-bit lane: the low nibbles' bytes in $0,
# the high nibbles' in $1 (a jit function reads module globals only as constexpr)
E2M1_AS_E4M3_PTX = """
{
.reg .b32 a<2>;
and.b32 a0, $2, 0x08080808;
shl.b32 a0, a0, 4;
and.b32 a1, $2, 0x07070707;
shl.b32 a1, a1, 2;
or.b32 $0, a0, a1;
and.b32 a0, $2, 0x80808080;
shr.b32 a1, $2, 2;
and.b32 a1, a1, 0x1c1c1c1c;
or.b32 $1, a0, a1;
}
"""
_E2M1_AS_E4M3_ASM = tl.constexpr(E2M1_AS_E4M3_PTX)


@triton.jit
def e2m1_as_e4m3(b, ASM: tl.constexpr):
    """Packed FP4 bytes (uint8, two E2M1 codes each) -> (low nibbles, high nibbles) as E4M3 bytes worth the
    E2M1 value * 2^-6, exact: the code's sign to bit 7, its 3 magnitude bits to bits 4..2 (code 1, 0.5, lands
    on the E4M3 subnormal 2^-7). ASM: four bytes per 32-bit lane in PTX (GPU); else plain uint8 lanes."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_E2M1_AS_E4M3_ASM, "=r,=r,r", [b], dtype=(tl.uint8, tl.uint8),
                                           is_pure=True, pack=4)
    else:
        lo = ((b & 8) << 4) | ((b & 7) << 2)
        hi = (b & 0x80) | ((b >> 2) & 0x1C)
    return lo, hi


# per pair k (the nibbles at bits 4k and 4k + 16): the shift that puts a nibble's magnitude bits on bf16 bits
# 8..6, and the one that puts its sign on bit 15
_PAIR_SHIFTS = (("shl", 6, 12), ("shl", 2, 8), ("shr", 2, 4), ("shr", 6, 0))


def e2m1_pairs_ptx(src: str, pairs: tuple = (0, 1, 2, 3), outs: tuple = ("$0", "$1", "$2", "$3"),
                   factors: tuple = ("$5", "$6")) -> str:
    """PTX that places the E2M1 nibble pairs of the 32-bit register `src` as bf16x2 values times a factor:
    pair k is the nibbles at bits 4k and 4k + 16; each nibble's 3 magnitude bits land on bf16 bits 8..6 (the
    exponent's low two and the mantissa's top: E2M1 value * 2^-126, codes 0 and 1 on 0 and the subnormal
    2^-127) and its sign on bit 15 of its half; then one mul.rn.bf16x2. Output outs[i] is pair pairs[i], times
    factors[0] for outs 0 and 2, factors[1] for outs 1 and 3. Scratch registers m and s."""
    lines = []
    for i, k in enumerate(pairs):
        way, mag, sign = _PAIR_SHIFTS[k]
        lines += [f"{way}.b32 m, {src}, {mag}", f"shl.b32 s, {src}, {sign}", "and.b32 m, m, 0x01C001C0",
                  "and.b32 s, s, 0x80008000", "or.b32 m, m, s", f"mul.rn.bf16x2 {outs[i]}, m, {factors[i % 2]}"]
    return "".join(line + ";\n" for line in lines)


# Packed E2M1 bytes -> bf16 worth value * 2^-126, times a bf16 factor. Four bytes in $4, reordered (b0 b2 b1 b3)
# so that a pair's two nibbles sit 16 bits apart: $0 $1 the low nibbles' values (bytes 0-1: the pair at bits 0,
# bytes 2-3: at bits 8), $2 $3 the high nibbles' (bits 4, bits 12); factors $5 (bytes 0-1) and $6 (bytes 2-3).
E2M1_BF16_SCALED_PTX = "{\n.reg .b32 w, m, s;\nprmt.b32 w, $4, 0, 0x3120;\n" + e2m1_pairs_ptx("w", (0, 2, 1, 3)) + "}\n"
_E2M1_BF16_SCALED_ASM = tl.constexpr(E2M1_BF16_SCALED_PTX)


@triton.jit
def e2m1_scaled_pairs(b, f, DT: tl.constexpr):
    """Packed FP4 bytes (uint8, any shape) and a factor per byte (its shape, DT; exactly representable in bf16:
    convert before broadcasting) -> (low nibbles, high nibbles) worth the E2M1 value * 2^-126 * f, exact, as
    DT. bf16: the bit
    assembly of E2M1_BF16_SCALED_PTX (four bytes a lane, about 2.6 instructions a value); float32 (the
    interpreter, which runs no PTX): the same bit placement in float32 lanes (bf16 is float32's top half)."""
    if DT == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(_E2M1_BF16_SCALED_ASM, "=r,=r,=r,=r,r,r,r", [b, f],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        x = b.to(tl.int32)
        lo = ((((x & 7) << 6) | ((x & 8) << 12)) << 16).to(tl.float32, bitcast=True) * f
        hi = (((((x >> 4) & 7) << 6) | (((x >> 4) & 8) << 12)) << 16).to(tl.float32, bitcast=True) * f
    return lo.to(DT), hi.to(DT)


@triton.jit
def e4m3_operand(byte, FP8: tl.constexpr):
    """E4M3 bytes (uint8) -> dot operand: float8e4nv (FP8), or (interpreter) their exact float32 values."""
    if FP8:
        return byte.to(tl.float8e4nv, bitcast=True)
    else:
        return e4m3_value(byte.to(tl.int32))


@triton.jit
def e8m0_bf16_factor(byte, OFFSET: tl.constexpr):
    """E8M0 bytes s (int32 lanes) -> the bf16 power of two 2^(s + OFFSET - 127) from its exponent bits (a form's
    scale with a constant folded in); NaN where that passes bf16's range (s > 254 - OFFSET), so a scale out of a
    form's range shows in its output instead of being wrong (e8m0_bytes_at_most checks a weight ahead)."""
    return tl.where(byte <= 254 - OFFSET, (byte + OFFSET) << 7, 0x7FC0).to(tl.int16).to(tl.bfloat16, bitcast=True)


def e8m0_bytes_at_most(max_byte: int, *scales: torch.Tensor) -> bool:
    """Whether every E8M0 byte of `scales` is <= max_byte: a device read, for load time."""
    return all(s.numel() == 0 or int(s.view(torch.uint8).max()) <= max_byte for s in scales)


@triton.jit
def pow2_scale_up(amax, inv_max):
    """2^ceil(log2(amax * inv_max)) from the float's exponent bits, as engine.quant.pow2_scale_up."""
    x = amax * inv_max
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    ceil_log2 = exponent - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((ceil_log2 + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_reciprocal(scale):
    """1 / scale for a power-of-two scale (pow2_scale_up's), one IEEE division: exact (1 / 2^e is a float, also as
    a subnormal), so x * pow2_reciprocal(scale) is x / scale's own rounding, bit for bit, at a multiply a value
    (an infinite scale gives 0, a zero one inf: the same 0, NaN or inf as the division)."""
    return tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def e4m3_code(v):
    """float32 in [-448, 448] -> E4M3 byte (int32 lane), round to nearest even."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    m3 = mant >> 20
    rem = mant & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((m3 & 1) == 1))
    normal_code = ((exponent + 7) << 3) + m3 + up.to(tl.int32)
    # below 2^-6 the grid is uniform with step 2^-9; code 8 (= 2^-6) continues into the normals
    s = a * 512.0
    f = tl.floor(s)
    r = s - f
    fi = f.to(tl.int32)
    sub_up = (r > 0.5) | ((r == 0.5) & ((fi & 1) == 1))
    sub_code = fi + sub_up.to(tl.int32)
    code = tl.where(a < 0.015625, sub_code, normal_code)
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 7)


@triton.jit
def e4m3_rounded(v):
    """float32 in [-448, 448] -> its E4M3 value (round to nearest even), as float32: e4m3_value(e4m3_code(v))
    without the byte. Normals: the mantissa rounded to 3 bits on the float's own bits (a carry into the
    exponent is the right answer); below 2^-6, the uniform 2^-9 grid by adding and taking off 1.5 x 2^14
    (whose float32 ulp is 2^-9); the sign kept on the bits (a tiny negative rounds to -0, as its code does)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = tl.where(a < 0.015625, (a + 24576.0) - 24576.0, normal)
    sign = v.to(tl.int32, bitcast=True) & -0x80000000
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_code(v):
    """float32 in [-6, 6] -> 4-bit E2M1 code (int32 lane, bit 3 = sign), round to nearest even."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


def interpreted() -> bool:
    """Whether Triton runs the kernels in its interpreter (TRITON_INTERPRET=1), as set now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# the same, for this module's jit functions (fixed at import: tests/interpreted.py reloads the module so)
_INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def bf16_rne_bits(v):
    """float32 v to bf16, rounded to nearest even by bit arithmetic (any Triton, the interpreter included).
    The MoE's tile epilogues keep this form: under the narrow tiles' register cap the native cast moved the
    allocation and added 13 register moves to the gate/up K loop (sm_90, triton 3.6), for an epilogue that
    runs once a tile."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000  # a carry into the exponent is the right answer
    return tl.where(v != v, v, b.to(tl.float32, bitcast=True)).to(tl.bfloat16)  # NaN stays NaN


@triton.jit
def cast_rne(v, ty: tl.constexpr):
    """float32 v as `ty`; to bf16 rounded to nearest even. Compiled: the cast itself (cvt.rn, one instruction a
    value or a pair); interpreted: `bf16_rne_bits`, since the interpreter's cast rounds half up without the
    carry. The same bits either way (NaN stays NaN). Other types by the cast."""
    if ty == tl.bfloat16:
        if _INTERPRETED:
            return bf16_rne_bits(v)
        else:
            # the bit form costs ~6 integer instructions a value on sm_90: the mHC's 64 x 64 chunk loop 1,426 SASS
            # instructions with it, 549 of them integer, against 1,019 and 310 with the cast (triton 3.6)
            return v.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        return v.to(ty)


@triton.jit
def bf16_output(v, out_ptr):
    """float32 v as a bf16 output stores it, rounded to nearest even by cast_rne: bf16, or (a float32 output: what
    the reference numerics keep) its bf16 value. (The interpreter's plain cast rounds otherwise, so a bf16 output
    interpreted drifted from the float32 one by up to a step.)"""
    if out_ptr.dtype.element_ty == tl.float32:
        return cast_rne(v, tl.bfloat16).to(tl.float32)
    else:
        return cast_rne(v, tl.bfloat16)


def register_cap(maxnreg: int | None) -> dict:
    """Launch options for a register cap per thread (none for 0 or None): more programs per SM for a
    kernel held to few by its registers, at the price of spills."""
    return {"maxnreg": int(maxnreg)} if maxnreg else {}


_SM_COUNT: dict = {}


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); off the GPU the H200's 132, so the
    interpreter takes the same launch shapes as the H200."""
    device = torch.device(device)
    if device.type != "cuda":
        return 132
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def dot_dtype():
    """Operand type for tl.dot: bf16 on the GPU; float32 under TRITON_INTERPRET=1, whose bf16 dot is
    wrong (seen with triton 3.7.1: a 16x16 bf16 product off by 1e10)."""
    return tl.float32 if interpreted() else tl.bfloat16


# -- the Hopper MMA K order (a dot's K order is free as long as both operands share it) ---------------

@triton.jit
def in_mma_k_order(w, BK: tl.constexpr):
    """A [R, BK] tile in memory order -> the MMA K order of each 64 block (a register relabelling where the tile
    feeds a dot's register operand): memory column m = 16 c + 4 s + 2 h + t goes to 16 s + 8 h + 2 c + t. A
    Hopper MMA's register operand gives lane c of a quad K columns 2 c + {0, 1, 8, 9} of each 16; in this order
    they are the weight's bytes 16 c .. 16 c + 15 (one 16-byte shared load per row, not eight of 2 bytes)."""
    R: tl.constexpr = w.shape[0]
    w = tl.reshape(w, (R, BK // 64, 4, 4, 2, 2))  # [., c, s, h, t]
    return tl.reshape(tl.permute(w, (0, 1, 3, 4, 2, 5)), (R, BK))  # [., s, h, c, t]
