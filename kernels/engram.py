"""The Engram's gated update in one pass (engine/model/engram.py `engram_mix`).

x [T, hc, D] the stream (float32 or bf16), kv [T, (hc + 1) * D] the wkv projection (hc keys, then the
value), q_weight / k_weight [hc, D], token_mask bool [T] or None -> float32 [T, hc, D]:
    out[t, c] = x[t, c] + gate[t, c] * value[t]
    gate = sigmoid(copysign(sqrt(max(|dot|, GATE_CLAMP)), dot)), 0 where the token is masked
    dot = sum(x * (q_weight * k_weight) * key) / (rms(x) * rms(key) * sqrt(D)), each rms with eps inside
round_bf16: the outputs rounded to bf16 values (to nearest even), as the reference numerics store them.

One program per (token, copy), the whole row in registers: x, its key and the value read once, the row
written once. The wrapped numerics take ~20 launches over [T, hc, D] float32 temporaries for this (a
4,096-token prefill at the release's widths: ~3 ms of glue on the H200 in run 18c's profile, against a
read and a write of ~0.9 GB). Sums are tree reductions, not torch's order: results differ from the
reference in the last float32 bits (rarely one bf16 step after rounding); the tests bound both. A zero
dot takes the positive root, as torch's: its sums start from +0, so a sum of negative zeros comes out +0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rmsnorm import _inv_rms, _rounded

MAX_WIDTH = 16384  # the longest row one program holds in registers


def _check(x, kv, q_weight, k_weight, token_mask):
    if x.dim() != 3:
        raise ValueError(f"Engram mix: x must be [T, hc, D], got {tuple(x.shape)}")
    t, hc, d = x.shape
    if tuple(kv.shape) != (t, (hc + 1) * d):
        raise ValueError(f"Engram mix: kv must be [{t}, {(hc + 1) * d}], got {tuple(kv.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (hc, d):
            raise ValueError(f"Engram mix: {name} must be [{hc}, {d}], got {tuple(w.shape)}")
    if token_mask is not None and (tuple(token_mask.shape) != (t,) or token_mask.dtype != torch.bool):
        raise ValueError(f"Engram mix: token_mask must be bool [{t}], got {token_mask.dtype} {tuple(token_mask.shape)}")
    return t, hc, d


def engram_mix_reference(x, kv, q_weight, k_weight, eps: float, token_mask=None, round_bf16: bool = False,
                         bf16_out: bool = False):
    """The engine's op (float32 torch), rounded to bf16 values if asked (bf16_out: stored bf16)."""
    from engine.model.engram import engram_mix
    _check(x, kv, q_weight, k_weight, token_mask)
    out = engram_mix(x.float(), kv, q_weight, k_weight, eps, token_mask)
    return out.bfloat16() if bf16_out else out.bfloat16().float() if round_bf16 else out


@triton.jit
def _engram_mix_kernel(x_ptr, kv_ptr, qw_ptr, kw_ptr, mask_ptr, out_ptr, eps, inv_sqrt_d, clamp,
                       HC: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, HAS_MASK: tl.constexpr,
                       ROUND: tl.constexpr):
    row = tl.program_id(0)  # token * HC + copy
    tok = row // HC
    copy = row % HC
    d = tl.arange(0, BD)
    m = d < D
    h = tl.load(x_ptr + row.to(tl.int64) * D + d, mask=m, other=0.0).to(tl.float32)
    kv_row = kv_ptr + tok.to(tl.int64) * ((HC + 1) * D)
    key = tl.load(kv_row + copy * D + d, mask=m, other=0.0).to(tl.float32)
    w = tl.load(qw_ptr + copy * D + d, mask=m, other=0.0) * tl.load(kw_ptr + copy * D + d, mask=m, other=0.0)
    rstd = _inv_rms(tl.sum(h * h, axis=0), eps, D) * _inv_rms(tl.sum(key * key, axis=0), eps, D)
    dot = tl.sum(h * w * key, axis=0) * rstd * inv_sqrt_d
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), clamp))
    gate = tl.sigmoid(tl.where(dot < 0, -root, root))  # a zero dot takes the positive root (see the docstring)
    if HAS_MASK:
        gate = tl.where(tl.load(mask_ptr + tok) != 0, gate, 0.0)
    value = tl.load(kv_row + HC * D + d, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * D + d, _rounded(h + gate * value, out_ptr, ROUND), mask=m)


def engram_mix_triton(x, kv, q_weight, k_weight, eps: float, token_mask=None, round_bf16: bool = False,
                      num_warps: int | None = None, bf16_out: bool = False):
    """See the module docstring; one launch of T x hc programs. bf16_out: the rounded stream stored bf16
    (x may be bf16 too: the kernel widens what it loads)."""
    from engine.model.engram import GATE_CLAMP
    t, hc, d = _check(x, kv, q_weight, k_weight, token_mask)
    if d > MAX_WIDTH:
        raise ValueError(f"Engram mix: rows of {d} pass the kernel's {MAX_WIDTH}")
    out = torch.empty(x.shape, dtype=torch.bfloat16 if bf16_out else torch.float32, device=x.device)
    if t == 0:
        return out
    bd = triton.next_power_of_2(d)
    mask = token_mask.view(torch.uint8) if token_mask is not None else out  # unread without a mask
    _engram_mix_kernel[(t * hc,)](
        x.contiguous(), kv.contiguous(), q_weight.float().contiguous(), k_weight.float().contiguous(), mask, out,
        float(eps), float(d) ** -0.5, GATE_CLAMP, HC=hc, D=d, BD=bd, HAS_MASK=token_mask is not None,
        ROUND=round_bf16 or bf16_out, num_warps=num_warps or max(1, min(8, bd // 512)))
    return out
