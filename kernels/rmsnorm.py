"""RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * weight, optionally stored bf16-rounded.

Shapes: x float32 or bf16 [..., D]; weight float32 [D] or None -> float32 [..., D]. round_bf16: each
output rounded to bf16 (to nearest even) but kept as float32, as the reference numerics store an
activation (engine/ops/reference.py `act`); the engine then needs no rounding copy of its own.
out_dtype=torch.bfloat16: those rounded values stored as bf16 (half the bytes written; with bf16 rows in,
the 4-byte-per-value row PERFORMANCE.md's goal assumes).

One program per block of rows, the whole row in registers (D up to 16K): one read of x, one write.
Or (`programs_per_sm`) a few programs per SM, each walking rows with the next row's load issued before
this row's reduction, and the weight loaded once per program instead of once per row.
Or (`chunk`) the row read twice in chunks of a power-of-two width: squares summed over the chunks, then the
chunks read again (from L1/L2) to normalize and store; no lanes masked where the chunk divides D (5120 =
5 x 1024, where a whole row pads to 8192), a small register footprint, so many programs an SM.
`hints`: eviction policies (evict_first on data read for the last time and on the output, evict_last on
the chunked form's first read, so its re-read hits).
The sum of squares is a tree reduction, not torch's order, so results differ from the reference in the
last fp32 bits (and rarely by one bf16 step after rounding); the test bounds both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import cast_rne, sm_count

MAX_WIDTH = 16384  # the longest row one program holds in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       round_bf16: bool = False, out_dtype: torch.dtype = torch.float32, **_launch) -> torch.Tensor:
    """engine/ops/fp32.py's rms_norm (float32), rounded to bf16 values if asked (or stored bf16)."""
    from engine.ops.fp32 import rms_norm
    y = rms_norm(x, weight, eps)
    return y.to(out_dtype) if out_dtype == torch.bfloat16 else y.bfloat16().float() if round_bf16 else y


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                     HAS_W: tl.constexpr, ROUND: tl.constexpr, DROP: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    m = (r < rows)[:, None] & (d < D)[None, :]
    offs = r.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0, eviction_policy=DROP).to(tl.float32)
    y = _normalized(x, eps, D)
    if HAS_W:  # loaded after the reduction, not live across it (sm_90: 44 registers, 58 loaded before it)
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0)[None, :]
    tl.store(y_ptr + offs, _rounded(y, y_ptr, ROUND), mask=m, eviction_policy=DROP)


@triton.jit
def _inv_rms(ss, eps, D: tl.constexpr):
    """1 / sqrt(ss / D + eps) for sums of squares ss, the root and the divide each rounded once."""
    ms = ss / D + eps
    return tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms))


@triton.jit
def _normalized(x, eps, D: tl.constexpr):
    """Rows x [R, BD] (float32, zero past D) over their root mean square."""
    return x * _inv_rms(tl.sum(x * x, axis=1), eps, D)[:, None]


@triton.jit
def _rounded(y, y_ptr, ROUND: tl.constexpr):
    """y as stored: rounded to bf16 values (to nearest even) when asked or when y_ptr is bf16."""
    if ROUND:
        y = cast_rne(y, tl.bfloat16)
        if y_ptr.dtype.element_ty != tl.bfloat16:
            y = y.to(tl.float32)
    return y


@triton.jit
def _rms_norm_rows_kernel(x_ptr, w_ptr, y_ptr, rows, eps, D: tl.constexpr, BD: tl.constexpr,
                          HAS_W: tl.constexpr, ROUND: tl.constexpr, DROP: tl.constexpr):
    """Rows pid, pid + G, ... (G programs): row r + G is loaded before row r is reduced and stored."""
    step = tl.num_programs(0)
    dw = tl.arange(0, BD)
    if HAS_W:
        w = tl.load(w_ptr + dw, mask=dw < D, other=0.0)[None, :]
    d = dw[None, :]  # one row as a [1, BD] tile
    dm = d < D
    # row pointers carried and advanced by G rows: 64-bit addresses without 64-bit row indices
    xr = x_ptr + tl.program_id(0) * D
    yr = y_ptr + tl.program_id(0) * D
    x = tl.load(xr + d, mask=dm & (tl.program_id(0) < rows), other=0.0, eviction_policy=DROP).to(tl.float32)
    for r in range(tl.program_id(0), rows, step):
        xr += step * D
        x_next = tl.load(xr + d, mask=dm & (r + step < rows), other=0.0, eviction_policy=DROP).to(tl.float32)
        y = _normalized(x, eps, D)
        if HAS_W:
            y = y * w
        tl.store(yr + d, _rounded(y, y_ptr, ROUND), mask=dm, eviction_policy=DROP)
        yr += step * D
        x = x_next


@triton.jit
def _chunk(p, c: tl.constexpr, d, D: tl.constexpr, CH: tl.constexpr, EV: tl.constexpr):
    """Values c .. c + CH of the row at p as float32: unmasked where the chunk is whole, zero past D."""
    if c + CH <= D:
        v = tl.load(p + c + d, eviction_policy=EV)
    else:
        v = tl.load(p + c + d, mask=c + d < D, other=0.0, eviction_policy=EV)
    return v.to(tl.float32)


@triton.jit
def _rms_norm_chunked_kernel(x_ptr, w_ptr, y_ptr, rows, eps, D: tl.constexpr, CH: tl.constexpr,
                             HAS_W: tl.constexpr, ROUND: tl.constexpr, KEEP: tl.constexpr, DROP: tl.constexpr):
    """Rows pid, pid + G, ... (G programs), each in CH-wide chunks (loops unrolled): squares summed lane by
    lane over the chunks, then each chunk read again (one chunk ahead), normalized and stored. KEEP / DROP:
    eviction policy of the first read / of the re-read and the store."""
    d = tl.arange(0, CH)
    step = tl.num_programs(0).to(tl.int64) * D  # 64-bit: with a row a program, G x D may pass 2^31
    xr = x_ptr + tl.program_id(0).to(tl.int64) * D
    yr = y_ptr + tl.program_id(0).to(tl.int64) * D
    for _ in range(tl.program_id(0), rows, tl.num_programs(0)):
        acc = tl.zeros([CH], tl.float32)
        for c in tl.static_range(0, D, CH):
            x = _chunk(xr, c, d, D, CH, KEEP)
            acc += x * x
        inv = _inv_rms(tl.sum(acc, axis=0), eps, D)
        x_next = _chunk(xr, 0, d, D, CH, DROP)
        for c in tl.static_range(0, D, CH):
            y = x_next * inv
            if c + CH < D:  # the next chunk's re-read issued before this chunk's store (which may alias it)
                x_next = _chunk(xr, c + CH, d, D, CH, DROP)
            if HAS_W:
                y = y * _chunk(w_ptr, c, d, D, CH, "")
            y = _rounded(y, y_ptr, ROUND)
            if c + CH <= D:
                tl.store(yr + c + d, y, eviction_policy=DROP)
            else:
                tl.store(yr + c + d, y, mask=c + d < D, eviction_policy=DROP)
        xr += step
        yr += step


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    round_bf16: bool = False, rows_per_program: int | None = None,
                    out_dtype: torch.dtype = torch.float32, programs_per_sm: int = 0,
                    num_warps: int | None = None, chunk: int = 0, hints: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel; rows_per_program: rows a program normalizes (default: 1 for rows of 4K+ values, more
    for short rows, so that a program loads at least ~4K values); programs_per_sm > 0: the row-walking
    kernel with that many programs an SM instead; chunk > 0 (a power of two): the chunked form, a row a
    program or (programs_per_sm) walking rows, rows_per_program unused; hints: eviction policies; out_dtype
    float32, or bfloat16 (the values rounded to nearest even: round_bf16 implied). out: a buffer to write
    instead of a new one (x's shape, out_dtype, contiguous, x's device; checked on its metadata only, no
    sync), returned itself."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if d > MAX_WIDTH:
        raise ValueError(f"rows of {d} values do not fit one program (at most {MAX_WIDTH})")
    if chunk < 0 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be 0 or a power of two, got {chunk}")
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        _check_out(out, x, out_dtype)
    x2 = x.reshape(-1, d).contiguous()
    rows = x2.shape[0]
    y = out.view(rows, d)
    if rows == 0:
        return out
    bd = triton.next_power_of_2(d)
    br = rows_per_program or max(1, min(16, 4096 // bd))
    w = weight.float().contiguous() if weight is not None else y
    common = dict(HAS_W=weight is not None, ROUND=bool(round_bf16) or out_dtype == torch.bfloat16,
                  DROP="evict_first" if hints else "")
    walkers = min(rows, programs_per_sm * sm_count(x.device)) if programs_per_sm else 0
    if chunk:
        ch = min(chunk, bd)
        _rms_norm_chunked_kernel[(walkers or rows,)](x2, w, y, rows, float(eps), D=d, CH=ch,
                                                     KEEP="evict_last" if hints else "", **common,
                                                     num_warps=num_warps or max(1, min(8, ch // 256)))
    elif programs_per_sm:
        _rms_norm_rows_kernel[(walkers,)](x2, w, y, rows, float(eps), D=d, BD=bd, **common,
                                          num_warps=num_warps or (8 if bd >= 4096 else 4))
    else:
        _rms_norm_kernel[(triton.cdiv(rows, br),)](x2, w, y, rows, float(eps), D=d, BD=bd, BR=br, **common,
                                                  num_warps=num_warps or (8 if bd * br >= 4096 else 4))
    return out


def _check_out(out: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> None:
    """A ValueError naming what is wrong when `out` cannot take the call's result (metadata only)."""
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if out.dtype != out_dtype:
        raise ValueError(f"out must be {out_dtype} (the call's out_dtype), got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {tuple(out.stride())} for shape {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"out must be on x's device {x.device}, got {out.device}")
