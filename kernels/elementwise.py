"""Two elementwise steps of the shared expert, each one pass where the wrapped numerics take several launches
over float32 temporaries (engine/model/moe.py MoE.forward):

- `swiglu`: silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamps for limit <= 0), as moe.swiglu;
- `add`: a + b (the routed experts' sum plus the shared expert's output).

Both take float32 (or bf16) tensors of one shape and return float32; round_bf16: rounded to bf16 values (to
nearest even), as the reference numerics store an activation; bf16_out: those values stored as a bf16 tensor (for
a reader that widens what it loads: half the bytes written and read). The add is IEEE's, so its bits are torch's;
silu here is x * sigmoid(x) in float32, which can sit one bf16 step from torch's where the float32 results
straddle a rounding boundary (the tests bound it). At a 4,096-token prefill of the release (inter 2304, dim
5120): ~1 GB of the shared expert's ~1.2 GB of elementwise traffic and ~10 launches go.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rmsnorm import _rounded

BLOCK = 2048


def _check(a, b):
    if a.shape != b.shape:
        raise ValueError(f"elementwise: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")


def _stored(out: torch.Tensor, round_bf16: bool, bf16_out: bool) -> torch.Tensor:
    return out.bfloat16() if bf16_out else out.bfloat16().float() if round_bf16 else out


def swiglu_reference(gate, up, limit: float, round_bf16: bool = False, bf16_out: bool = False):
    """engine/model/moe.py's swiglu in float32, rounded to bf16 values if asked."""
    from engine.model.moe import swiglu
    _check(gate, up)
    return _stored(swiglu(gate.float(), up.float(), limit), round_bf16, bf16_out)


def add_reference(a, b, round_bf16: bool = False, bf16_out: bool = False):
    _check(a, b)
    return _stored(a.float() + b.float(), round_bf16, bf16_out)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, CLAMP: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + i, _rounded(g * tl.sigmoid(g) * u, out_ptr, ROUND), mask=m)


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(a_ptr + i, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, _rounded(a + b, out_ptr, ROUND), mask=m)


def swiglu_triton(gate, up, limit: float, round_bf16: bool = False, bf16_out: bool = False):
    _check(gate, up)
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty(g.shape, dtype=torch.bfloat16 if bf16_out else torch.float32, device=g.device)
    if out.numel():
        _swiglu_kernel[(triton.cdiv(out.numel(), BLOCK),)](g, u, out, out.numel(), float(limit), CLAMP=limit > 0,
                                                            ROUND=round_bf16 or bf16_out, BLOCK=BLOCK, num_warps=4)
    return out


def add_triton(a, b, round_bf16: bool = False, bf16_out: bool = False):
    _check(a, b)
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(a.shape, dtype=torch.bfloat16 if bf16_out else torch.float32, device=a.device)
    if out.numel():
        _add_kernel[(triton.cdiv(out.numel(), BLOCK),)](a, b, out, out.numel(), ROUND=round_bf16 or bf16_out,
                                                        BLOCK=BLOCK, num_warps=4)
    return out
