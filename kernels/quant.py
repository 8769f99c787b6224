"""Cache and activation quantizers (FP4 E2M1 with E8M0/E4M3 scales, FP8 E4M3 with E8M0 per 32).

Bit-exact with engine/quant.py: `quantize_fp4_reference` / `quantize_fp8_reference` ARE the engine's
functions; the Triton versions must produce identical bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import quant as Q
from kernels._formats import e2m1_code, e4m3_code, e4m3_rounded, fp4_value, pow2_reciprocal, pow2_scale_up
from kernels.fp4_tiles import nib_order


def quantize_fp4_reference(x: torch.Tensor, block: int, scale_kind: str = "e8m0", values: bool = False):
    """[..., K] -> (int8 [..., K/2], scales [..., K/block] float8_e8m0fnu or float8_e4m3fn[, values float32
    [..., K]: what loading them gives back, engine.quant.quantize_fp4_with_values])."""
    if values:
        return Q.quantize_fp4_with_values(x, block, scale_kind)
    packed, scale = Q.quantize_fp4(x.cpu() if x.device.type != "cpu" else x, block, scale_kind)
    return packed.to(x.device), scale.to(x.device)


def quantize_fp8_reference(x: torch.Tensor, block: int = 32):
    """[..., K] -> (float8_e4m3fn [..., K], float8_e8m0fnu [..., K/block])."""
    q, s = Q.quantize_fp8(x.cpu() if x.device.type != "cpu" else x, block)
    return q.to(x.device), s.to(x.device)


@triton.jit
def _fp4_quant_kernel(x_ptr, q_ptr, s_ptr, v_ptr, n_groups, BLOCK: tl.constexpr, BG: tl.constexpr,
                      E4M3_SCALE: tl.constexpr, VALUES: tl.constexpr = False):
    pid = tl.program_id(0)
    g = pid * BG + tl.arange(0, BG)  # [BG] group ids
    gmask = g < n_groups
    j = tl.arange(0, BLOCK // 2)
    k = tl.arange(0, BLOCK)
    offs = g[:, None] * BLOCK + k[None, :]
    m2 = gmask[:, None]
    # the group read whole and split into its even and odd values in registers (two stride-2 loads compiled to
    # scalar loads)
    x = tl.load(x_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    x_even, x_odd = tl.split(tl.reshape(x, (BG, BLOCK // 2, 2)))
    amax = tl.max(tl.abs(x), axis=1)
    if E4M3_SCALE:
        # IEEE division (div_rn): Triton's plain fp32 '/' is approximate on the GPU and broke bit-exactness
        s_code = e4m3_code(tl.minimum(tl.div_rn(tl.maximum(amax, 6.0 * 0.001953125), tl.full(amax.shape, 6.0, tl.float32)), 448.0))
        exp = (s_code >> 3) & 15
        man = s_code & 7
        s_norm = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        scale = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, s_norm)
        s_byte = s_code
        sb = tl.broadcast_to(scale[:, None], x_even.shape)
        lo = e2m1_code(tl.minimum(tl.maximum(tl.div_rn(x_even, sb), -6.0), 6.0))
        hi = e2m1_code(tl.minimum(tl.maximum(tl.div_rn(x_odd, sb), -6.0), 6.0))
    else:
        scale = pow2_scale_up(tl.maximum(amax, 6.0 * 1.1754943508222875e-38), 1.0 / 6.0)
        s_byte = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        s_byte = tl.where(s_byte == 0, 0, s_byte)
        inv = pow2_reciprocal(scale)[:, None]  # a power of two in 2^-126..2^126
        lo = e2m1_code(tl.minimum(tl.maximum(x_even * inv, -6.0), 6.0))
        hi = e2m1_code(tl.minimum(tl.maximum(x_odd * inv, -6.0), 6.0))
    tl.store(q_ptr + g[:, None] * (BLOCK // 2) + j[None, :], (lo | (hi << 4)).to(tl.uint8), mask=m2)
    tl.store(s_ptr + g, s_byte.to(tl.uint8), mask=gmask)
    if VALUES:  # what loading the bytes gives back (exact: E2M1 value times an E8M0 / E4M3 scale)
        back = tl.join(fp4_value(lo), fp4_value(hi)) * scale[:, None, None]
        tl.store(v_ptr + offs, tl.reshape(back, (BG, BLOCK)), mask=m2)


@triton.jit
def fp8_groups(x_ptr, BLOCK: tl.constexpr, BG: tl.constexpr, n_groups):
    """This program's BG groups of BLOCK values, as engine.quant.quantize_fp8 computes them: the values over their
    scale clamped to E4M3's range (float32 [BG, BLOCK]; e4m3_code makes them the codes, e4m3_rounded the codes'
    values), the scales (float32 [BG]), offsets, group indices and group mask."""
    g = tl.program_id(0) * BG + tl.arange(0, BG)
    gmask = g < n_groups
    j = tl.arange(0, BLOCK)
    offs = g.to(tl.int64)[:, None] * BLOCK + j[None, :]
    x = tl.load(x_ptr + offs, mask=gmask[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    scale = pow2_scale_up(amax, 1.0 / 448.0)
    v = tl.minimum(tl.maximum(x * pow2_reciprocal(scale)[:, None], -448.0), 448.0)  # one division a group
    return v, scale, offs, g, gmask


@triton.jit
def _fp8_quant_kernel(x_ptr, q_ptr, s_ptr, n_groups, BLOCK: tl.constexpr, BG: tl.constexpr):
    v, scale, offs, g, gmask = fp8_groups(x_ptr, BLOCK, BG, n_groups)
    tl.store(q_ptr + offs, e4m3_code(v).to(tl.uint8), mask=gmask[:, None])
    tl.store(s_ptr + g, ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8), mask=gmask)


@triton.jit
def _fp8_roundtrip_kernel(x_ptr, y_ptr, n_groups, BLOCK: tl.constexpr, BG: tl.constexpr, NIB: tl.constexpr,
                          RS: tl.constexpr):
    v, scale, offs, g, gmask = fp8_groups(x_ptr, BLOCK, BG, n_groups)
    y = e4m3_rounded(v) * scale[:, None]  # the codes' values, no byte
    if NIB:  # the FP4 decoders' order (fp4_tiles.nib_order): each 8-group's halves interleaved, in registers (the
        # same permutation on the store's addresses made it 16 scalar stores a thread: 136 us a launch in H100 run
        # 34a, 17 in this form in 34b)
        y = tl.reshape(tl.permute(tl.reshape(y, (BG, BLOCK // 8, 2, 4)), (0, 1, 3, 2)), (BG, BLOCK))
    if RS:  # then moe_rs.rs_columns inside each 64 columns (two adjacent 32-groups of a row: a tile starts at an
        # even group): stored column bits s5 (the group's parity) .. s0 -> MMA position bits s3 s2 s1 s5 s4 s0
        y = tl.reshape(y, (BG // 2, 2, 2, 2, 2, 2, 2))
        y = tl.reshape(tl.permute(y, (0, 3, 4, 5, 1, 2, 6)), (BG, BLOCK))
    tl.store(y_ptr + offs, y, mask=gmask[:, None])


def quantize_fp4_triton(x: torch.Tensor, block: int, scale_kind: str = "e8m0", values: bool = False):
    """Triton twin of `quantize_fp4_reference` (same outputs, byte for byte); values: also what loading the
    bytes gives back (float32, x's shape), as engine.quant.quantize_fp4_with_values."""
    if scale_kind not in ("e8m0", "e4m3"):
        raise ValueError(f"unknown FP4 scale kind {scale_kind!r}")
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last dimension {k} is not a multiple of the FP4 group {block}")
    xc = x.contiguous()
    n_groups = xc.numel() // block
    q = torch.empty(*x.shape[:-1], k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(*x.shape[:-1], k // block, dtype=torch.uint8, device=x.device)
    v = torch.empty(x.shape, dtype=torch.float32, device=x.device) if values else q
    bg = 64
    if n_groups:
        _fp4_quant_kernel[(triton.cdiv(n_groups, bg),)](xc, q, s, v, n_groups, BLOCK=block, BG=bg,
                                                        E4M3_SCALE=scale_kind == "e4m3", VALUES=values)
    sdt = torch.float8_e4m3fn if scale_kind == "e4m3" else torch.float8_e8m0fnu
    return (q.view(torch.int8), s.view(sdt)) + ((v,) if values else ())


def quantize_fp8_triton(x: torch.Tensor, block: int = 32):
    """Triton twin of `quantize_fp8_reference` (same outputs, byte for byte)."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last dimension {k} is not a multiple of the FP8 group {block}")
    xc = x.contiguous()
    n_groups = xc.numel() // block
    q = torch.empty(*x.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty(*x.shape[:-1], k // block, dtype=torch.uint8, device=x.device)
    bg = 64
    _fp8_quant_kernel[(triton.cdiv(n_groups, bg),)](xc, q, s, n_groups, BLOCK=block, BG=bg)
    return q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def fp8_roundtrip_reference(x: torch.Tensor, block: int = 32, bf16_out: bool = False,
                            nib: bool = False, rs: bool = False) -> torch.Tensor:
    """engine.quant.fp8_roundtrip: x as an E4M3 store (E8M0 per `block`) and load leave it, float32
    (bf16_out: bf16, the same values; nib: the last dimension in the FP4 decoders' order, fp4_tiles.nib_order;
    rs: then in the register-operand experts' MMA order, moe_rs.rs_columns)."""
    y = Q.fp8_roundtrip(x, block)
    y = y.bfloat16() if bf16_out else y
    if not nib:
        return y
    rows = nib_order(y.reshape(-1, y.shape[-1]))
    if rs:
        from kernels.moe_rs import rs_columns  # (moe_rs imports the Gluon forms where they exist)
        rows = rs_columns(rows)
    return rows.view(y.shape)


def fp8_roundtrip_triton(x: torch.Tensor, block: int = 32, bf16_out: bool = False,
                         nib: bool = False, rs: bool = False) -> torch.Tensor:
    """The quantizer's codes and scales turned back into values in the same launch (the engine's form takes
    ~20 launches): dequantize_fp8(*quantize_fp8(x)) bit for bit, so the engine's fp8_roundtrip too. bf16_out:
    stored bf16, the same values (an E4M3 value times a power of two within float32's range is a bf16). nib:
    stored in the FP4 decoders' order inside each 8-group (fp4_tiles.nib_order), for the MoE's grouped GEMM:
    the permutation made in registers before the store, where a separate nib_order was a 58 us copy of a 4K
    prefill's expert input (H100 run 31f). rs (with nib): then in the register-operand experts' MMA order inside
    each 64 columns (moe_rs.rs_columns of the nib output), in the same launch instead of a copy after it."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last dimension {k} is not a multiple of the FP8 group {block}")
    if nib and block % 8:
        raise ValueError(f"the nibble order permutes inside 8-groups: the FP8 group {block} must hold whole ones")
    if rs and not (nib and block == 32 and k % 64 == 0):
        raise ValueError(f"the MMA order permutes the nibble order inside 64 columns: it needs nib, FP8 groups of "
                         f"32 (got {block}) and a last dimension of whole 64s (got {k})")
    xc = x.contiguous()  # widened as the kernel loads it
    y = torch.empty(xc.shape, dtype=torch.bfloat16 if bf16_out else torch.float32, device=xc.device)
    n_groups = xc.numel() // block
    if n_groups:
        bg = 64
        _fp8_roundtrip_kernel[(triton.cdiv(n_groups, bg),)](xc, y, n_groups, BLOCK=block, BG=bg, NIB=nib, RS=rs)
    return y
