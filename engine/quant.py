"""Reference (plain torch) versions of the release's number formats.

- FP8 E4M3 values with E8M0 (power-of-two) scales: dense weights in 32x32 blocks, activations and
  the sliding-window KV in groups of 32 along the last axis.
- FP4 E2M1 codes packed two per byte (even index in the low nibble, bit 3 of a nibble is the sign):
  routed-expert weights and index keys/queries with E8M0 scales per 32, the global KV with E4M3 scales
  per 16.

Scales round UP to a power of two (2^ceil(log2(amax / max))), so no value clips; round-to-nearest
would. The fast kernels in `kernels/` are checked against these functions.
"""

from __future__ import annotations

import torch

from .capture import capturing

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# signed table indexed by the 4-bit code (bit 3 = sign)
FP4_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])
# midpoints between neighbouring magnitudes; at an exact tie round to the even code (1, 3, 5 go up)
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


def pow2_scale_up(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """2^ceil(log2(amax / max_value)) in float32, exact (read off the float's exponent bits)."""
    x = (amax.float() * torch.tensor(1.0 / max_value, dtype=torch.float32)).contiguous()
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & ((1 << 23) - 1)
    ceil_log2 = exponent - 127 + (mantissa != 0).to(torch.int32)
    return ((ceil_log2 + 127) << 23).view(torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn, round to nearest even, saturating (a bare cast turns overflow into NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e8m0_from_float(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales -> float8_e8m0fnu (exact)."""
    return scale.float().to(torch.float8_e8m0fnu)


# -- FP4 E2M1 codes -----------------------------------------------------------------------------

def round_mantissa(x: torch.Tensor, mantissa_bits: int, min_exponent_bits) -> torch.Tensor:
    """Round float32 x to `mantissa_bits` mantissa bits, to nearest even, with steps never finer
    than those at the exponent `min_exponent_bits` (float32 exponent field << 23; a scalar or a
    tensor broadcasting against x): how a small float format with subnormals rounds. Adding and
    subtracting 1.5 * 2^23 * step makes the float unit do the rounding; valid for |x| < 2^100."""
    bits = x.view(torch.int32) & 0x7F800000
    bits = bits.clamp_min(min_exponent_bits) if isinstance(min_exponent_bits, int) \
        else torch.maximum(bits, min_exponent_bits)
    bits += (23 - mantissa_bits) << 23
    bits |= 1 << 22
    magic = bits.view(torch.float32)
    out = x + magic
    out -= magic
    return out


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Contiguous float32 values in [-6, 6] rounded to E2M1 (1 mantissa bit, steps of 0.5 below 1)."""
    return round_mantissa(v, 1, 127 << 23)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Values already in [-6, 6] -> 4-bit codes (uint8, bit 3 = sign), round to nearest even."""
    v = v.float().contiguous()
    return _e2m1_codes_of_rounded(round_e2m1(v), v)


def _e2m1_codes_of_rounded(rounded: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """E2M1 is 1 mantissa bit with subnormal steps of 0.5: a rounded magnitude r >= 1 has code
    2 * (exponent + 1) + mantissa bit, read off its float32 bits; r in {0, 0.5} has code 2r."""
    r = rounded.abs()
    code = (r.view(torch.int32) >> 22) - 252
    code = torch.where(r < 1, (r * 2).to(torch.int32), torch.where(r <= FP4_MAX, code, 0))  # NaN -> 0
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_codes_by_table(v: torch.Tensor) -> torch.Tensor:
    """`e2m1_codes` by comparison with the midpoints of the value table (the independent check)."""
    mag = v.float().abs().unsqueeze(-1)
    mids, tie_up = _E2M1_MIDS.to(v.device), _E2M1_TIE_UP.to(v.device)
    code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> int8 [..., K/2], the even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous().view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., K/2] -> float32 values [..., K] (unscaled E2M1)."""
    b = packed.contiguous().view(torch.uint8)
    table = FP4_TABLE.to(b.device)
    values = torch.stack([table[(b & 0x0F).long()], table[(b >> 4).long()]], dim=-1)
    return values.flatten(-2)


# -- weights ------------------------------------------------------------------------------------

def quantize_fp8_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn [out, in], E8M0 scales [ceil(out/b), ceil(in/b)])."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.view(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    scale = pow2_scale_up(amax, FP8_MAX)  # [rows, cols]
    q = to_e4m3(tiles / scale[:, None, :, None]).view(rows * block, cols * block)[:out_dim, :in_dim]
    return q.contiguous(), e8m0_from_float(scale)


def dequantize_fp8_weight(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of `quantize_fp8_weight`: float32 [out, in]."""
    out_dim, in_dim = q.shape
    s = scale.float().repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    return q.float() * s


def quantize_fp4_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 packed [out, in/2], E8M0 scales [out, in/block])."""
    packed, scale = quantize_fp4(w, block, "e8m0")
    return packed, scale


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of `quantize_fp4_weight`: float32 [out, in]."""
    return dequantize_fp4(packed, scale, block)


# -- FP4 groups along the last axis (weights, index keys, global KV) ---------------------------

def quantize_fp4(x: torch.Tensor, block: int, scale_kind: str = "e8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (int8 packed [..., K/2], scales [..., K/block]).

    scale_kind "e8m0": power-of-two scales rounded up (weights, index keys and queries).
    scale_kind "e4m3": scale = amax/6 rounded to E4M3 (the global KV entries)."""
    packed, scale, _ = quantize_fp4_with_values(x, block, scale_kind)
    return packed, scale


def quantize_fp4_with_values(x: torch.Tensor, block: int, scale_kind: str = "e8m0"):
    """`quantize_fp4` plus what loading the bytes gives back (float32 [..., K]), computed from
    the rounded values instead of the bytes: equal to dequantize_fp4 of them for every non-NaN x."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last dimension {k} is not a multiple of the FP4 group {block}")
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1)
    if scale_kind == "e8m0":
        scale_f = pow2_scale_up(amax.clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
        scale = e8m0_from_float(scale_f)
    elif scale_kind == "e4m3":
        scale = to_e4m3(amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX)
        scale_f = scale.float()
    else:
        raise ValueError(f"unknown FP4 scale kind {scale_kind!r}")
    v = (groups / scale_f.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX).contiguous()
    rounded = round_e2m1(v)
    packed = pack_fp4(_e2m1_codes_of_rounded(rounded, v).flatten(-2))
    return packed, scale, (rounded * scale_f.unsqueeze(-1)).flatten(-2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `quantize_fp4`: float32 [..., K]."""
    values = unpack_fp4(packed)
    return (values.unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)).flatten(-2)


def fp4_roundtrip(x: torch.Tensor, block: int, scale_kind: str = "e8m0") -> torch.Tensor:
    """What an FP4 store-and-load does to x (float32 result)."""
    return quantize_fp4_with_values(x, block, scale_kind)[2]


# -- FP8 groups along the last axis (activations, the sliding window) --------------------------

def quantize_fp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (float8_e4m3fn [..., K], E8M0 scales [..., K/block])."""
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1).clamp_min(1e-4)
    scale_f = pow2_scale_up(amax, FP8_MAX)
    q = to_e4m3(groups / scale_f.unsqueeze(-1)).flatten(-2)
    return q, e8m0_from_float(scale_f)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)).flatten(-2)


def fp8_roundtrip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What an FP8 (E4M3, E8M0 per `block`) store-and-load does to x (float32 result), without
    the byte round trip: bit-identical to dequantize_fp8(*quantize_fp8(x)) (tested), ~3x faster."""
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    # inf / NaN / beyond round_mantissa's range take the byte round trip; a graph being captured
    # cannot ask (a host read), so there non-finite input gives the fast form's values
    if not capturing() and not bool((amax < 2.0**100).all()):
        q, s = quantize_fp8(x, block)
        return dequantize_fp8(q, s, block)
    # E4M3 keeps 3 mantissa bits; below 2^-6 times the scale its steps stay 2^-9 (subnormals)
    floor = pow2_scale_up(amax, FP8_MAX).view(torch.int32) - (6 << 23)
    return round_mantissa(groups.contiguous(), 3, floor).flatten(-2)
