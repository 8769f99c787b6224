"""RoPE as the reference numerics rotate and store it (engine/ops/reference.py `rotate_by`), in one launch.

Shapes: x float32 [T, ..., D]; positions int [T]; table float32 [P, rd/2, 2], the (cos, sin) pairs of the
reference's polar table (ReferenceOps._rope_table viewed as real) -> float32 [T, ..., D]: the last rd dims
as complex products (x_re + i x_im)(cos + i sin) (sin negated when inverse), every value rounded to bf16
(nearest even) and kept float32. The reference's form takes ~8 launches (a bf16 copy, the pairs' copy,
the table gather, the complex product, its write-back, the float copy); this is one read and one write.
Products and sums are float32 as torch's complex product, but x cos fused into an FMA here (both kernels, spelled
out), so a value can sit one bf16 step away where the float32 result straddles a rounding boundary (the test
bounds it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import cast_rne


def rope_reference(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, inverse: bool = False,
                   inplace: bool = False):
    """engine/ops/reference.py's rotation by the table's rows at `positions` (inplace: written into a
    contiguous float32 or bf16 x, which is returned)."""
    from engine.ops.reference import rotate_by
    out = rotate_by(x, torch.view_as_complex(table[positions.long()].contiguous()), inverse)
    return x.copy_(out) if inplace and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous() else out


@triton.jit
def _rope_kernel(x_ptr, y_ptr, pos_ptr, tab_ptr, rows, per_token, D: tl.constexpr, BD: tl.constexpr,
                 RD: tl.constexpr, BR: tl.constexpr, CONJ: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    rmask = r < rows
    m = rmask[:, None] & (d < D)[None, :]
    row = r.to(tl.int64)[:, None] * D
    j = d - (D - RD)  # position inside the rotated part (negative: kept)
    rot = (j >= 0) & (d < D)
    x = tl.load(x_ptr + row + d[None, :], mask=m, other=0.0)
    xp = tl.load(x_ptr + row + tl.where(rot, d ^ 1, d)[None, :], mask=m, other=0.0)  # the pair's other half
    pos = tl.load(pos_ptr + r // per_token, mask=rmask, other=0).to(tl.int64)
    tm = rmask[:, None] & rot[None, :]
    at = tab_ptr + (pos[:, None] * (RD // 2) + (tl.maximum(j, 0) // 2)[None, :]) * 2
    c = tl.load(at, mask=tm, other=1.0)
    s = tl.load(at + 1, mask=tm, other=0.0)
    if CONJ:
        s = -s
    # real part (x real, xp imaginary) x c - xp s, imaginary part (xp real, x imaginary) x c + xp s: written as
    # the FMA the compiler made of them (x c fused, xp s rounded), which _rope_slice_kernel spells the same way
    p = xp * s
    y = tl.where(rot[None, :], tl.fma(x, c, tl.where(((j & 1) == 1)[None, :], p, -p)), x)
    tl.store(y_ptr + row + d[None, :], cast_rne(y, tl.bfloat16).to(tl.float32), mask=m)


@triton.jit
def _rope_slice_kernel(x_ptr, pos_ptr, tab_ptr, rows, per_token, D: tl.constexpr, RD: tl.constexpr,
                       BRD: tl.constexpr, BR: tl.constexpr, CONJ: tl.constexpr):
    """In place: the last RD dims of each row rotated and rounded; the other dims neither read nor written
    (each pair is read whole before it is stored, inside one program)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.arange(0, BRD)
    rmask = r < rows
    m = rmask[:, None] & (j < RD)[None, :]
    row = r.to(tl.int64)[:, None] * D + (D - RD)
    # each pair read whole and split in registers (a gather of the pair's other half and the table's stride-2
    # loads compiled to scalar loads and shared-memory shuffles)
    x = tl.load(x_ptr + row + j[None, :], mask=m, other=0.0).to(tl.float32)
    re, im = tl.split(tl.reshape(x, (BR, BRD // 2, 2)))
    pos = tl.load(pos_ptr + r // per_token, mask=rmask, other=0).to(tl.int64)
    cs = tl.load(tab_ptr + pos[:, None] * RD + j[None, :], mask=m, other=0.0)
    c, s = tl.split(tl.reshape(cs, (BR, BRD // 2, 2)))
    if CONJ:
        s = -s
    even = tl.fma(re, c, -(im * s))  # _rope_kernel's FMAs (left to the compiler, the two kernels' contractions
    odd = tl.fma(im, c, re * s)  # differed: GPU run 34 found the in-place result a bf16 step off the whole one)
    y = cast_rne(tl.reshape(tl.join(even, odd), (BR, BRD)), tl.bfloat16)
    if x_ptr.dtype.element_ty == tl.float32:
        y = y.to(tl.float32)
    tl.store(x_ptr + row + j[None, :], y, mask=m)


def rope_triton(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, inverse: bool = False,
                inplace: bool = False):
    """The kernel; same inputs and output as rope_reference. inplace: x holds bf16 values (the reference's
    activations, whose rounding leaves them as they are) and the caller has no further use for them: a
    contiguous float32 or bf16 x has only its last rd dims rewritten, in place (rd / D of the traffic: a
    4K-token prefill's queries read and wrote 1.1 GB for 64 of 512 dims, ~0.25 ms on the H200), and is
    returned."""
    d, rd = x.shape[-1], table.shape[1] * 2
    if table.dim() != 3 or table.shape[2] != 2 or rd > d or (d - rd) % 2:
        raise ValueError(f"table must be [P, rd/2, 2] with rd <= D and D - rd even (D {d}, table {tuple(table.shape)})")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"positions must be [T] = [{x.shape[0]}], got {tuple(positions.shape)}")
    if inplace and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous():
        rows = x.numel() // d
        if rows and rd:
            br = max(1, min(32, 2048 // triton.next_power_of_2(rd)))
            _rope_slice_kernel[(triton.cdiv(rows, br),)](x, positions.contiguous(), table.float().contiguous(), rows,
                                                        rows // x.shape[0], D=d, RD=rd, BRD=triton.next_power_of_2(rd),
                                                        BR=br, CONJ=bool(inverse), num_warps=4)
        return x
    x2 = x.float().reshape(-1, d).contiguous()
    rows = x2.shape[0]
    out = torch.empty_like(x2)
    if rows:
        bd = triton.next_power_of_2(d)
        br = max(1, min(16, 4096 // bd))
        _rope_kernel[(triton.cdiv(rows, br),)](x2, out, positions.contiguous(), table.float().contiguous(), rows,
                                              rows // x.shape[0], D=d, BD=bd, RD=rd, BR=br, CONJ=bool(inverse),
                                              num_warps=4)
    return out.view(x.shape)
