"""One entry point per kernel: Triton on CUDA (when triton imports), the PyTorch reference elsewhere.

Every function here has the same signature as its `*_reference` / `*_triton` pair in the kernel's
module; `compare(name, *args)` runs both and reports the largest absolute and relative difference.
"""

from __future__ import annotations

import importlib.util

import torch

from kernels import elementwise as _ew
from kernels import engram as _engram
from kernels import f32_gemm as _f32
from kernels import fp8_linear as _lin
from kernels import indexer as _idx
from kernels import mhc as _mhc
from kernels import moe as _moe
from kernels import quant as _q
from kernels import rmsnorm as _rms
from kernels import rope as _rope
from kernels import router as _router
from kernels import sparse_attn as _attn
from kernels import ties as _ties
from kernels import topk as _topk

_PAIRS = {
    "indexer_scores": (_idx.indexer_scores_reference, _idx.indexer_scores_triton),
    "indexer_topk": (_idx.indexer_topk_reference, _idx.indexer_topk_triton),
    "topk_positions": (_topk.topk_positions_reference, _topk.topk_positions_triton),
    "sparse_attn": (_attn.sparse_attn_reference, _attn.sparse_attn_triton),
    "moe_fp4": (_moe.moe_fp4_reference, _moe.moe_fp4_triton),
    "mhc": (_mhc.mhc_reference, _mhc.mhc_triton),
    "mhc_expand": (_mhc.mhc_expand_reference, _mhc.mhc_expand_triton),
    "fp8_linear": (_lin.fp8_linear_reference, _lin.fp8_linear_triton),
    "quantize_fp4": (_q.quantize_fp4_reference, _q.quantize_fp4_triton),
    "quantize_fp8": (_q.quantize_fp8_reference, _q.quantize_fp8_triton),
    "fp8_roundtrip": (_q.fp8_roundtrip_reference, _q.fp8_roundtrip_triton),
    "rms_norm": (_rms.rms_norm_reference, _rms.rms_norm_triton),
    "rope": (_rope.rope_reference, _rope.rope_triton),
    "tie_marks": (_ties.tie_marks_reference, _ties.tie_marks_triton),
    "engram_mix": (_engram.engram_mix_reference, _engram.engram_mix_triton),
    "swiglu": (_ew.swiglu_reference, _ew.swiglu_triton),
    "add": (_ew.add_reference, _ew.add_triton),
    "f32_gemm": (_f32.f32_gemm_reference, _f32.f32_gemm_triton),
    "route_topk": (_router.route_topk_reference, _router.route_topk_triton),
}


def use_triton(device) -> bool:
    """True when `device` is a CUDA device and triton can be imported."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def _device_of(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _call(name, *args, **kwargs):
    ref, fast = _PAIRS[name]
    return (fast if use_triton(_device_of(args)) else ref)(*args, **kwargs)


def indexer_scores(*args, **kwargs):
    return _call("indexer_scores", *args, **kwargs)


def indexer_topk(*args, **kwargs):
    return _call("indexer_topk", *args, **kwargs)


def topk_positions(*args, **kwargs):
    return _call("topk_positions", *args, **kwargs)


def sparse_attn(*args, **kwargs):
    return _call("sparse_attn", *args, **kwargs)


def moe_fp4(*args, **kwargs):
    return _call("moe_fp4", *args, **kwargs)


def mhc(*args, **kwargs):
    return _call("mhc", *args, **kwargs)


def mhc_expand(*args, **kwargs):
    return _call("mhc_expand", *args, **kwargs)


def rms_norm(*args, **kwargs):
    return _call("rms_norm", *args, **kwargs)


def rope(*args, **kwargs):
    return _call("rope", *args, **kwargs)


def tie_marks(*args, **kwargs):
    return _call("tie_marks", *args, **kwargs)


def swiglu(*args, **kwargs):
    return _call("swiglu", *args, **kwargs)


def add(*args, **kwargs):
    return _call("add", *args, **kwargs)


def f32_gemm(*args, **kwargs):
    return _call("f32_gemm", *args, **kwargs)


def route_topk(*args, **kwargs):
    return _call("route_topk", *args, **kwargs)


def engram_mix(*args, **kwargs):
    return _call("engram_mix", *args, **kwargs)


def fp8_linear(*args, **kwargs):
    return _call("fp8_linear", *args, **kwargs)


def quantize_fp4(*args, **kwargs):
    return _call("quantize_fp4", *args, **kwargs)


def quantize_fp8(*args, **kwargs):
    return _call("quantize_fp8", *args, **kwargs)


def fp8_roundtrip(*args, **kwargs):
    return _call("fp8_roundtrip", *args, **kwargs)


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if o is not None]


def compare(fn_name: str, *args, **kwargs) -> dict:
    """Run the reference and the Triton version on the same inputs.

    Returns {"name", "max_abs", "max_rel", "rel_l2", "mismatched_bytes"}: max_rel is max_abs over the
    reference's largest magnitude; for integer/FP8 outputs (indices, quantized bytes) max_abs counts
    differing elements' largest difference and mismatched_bytes the number of differing elements."""
    if fn_name not in _PAIRS:
        raise ValueError(f"unknown kernel {fn_name!r}; known: {', '.join(sorted(_PAIRS))}")
    ref, fast = _PAIRS[fn_name]
    a, b = _flat(ref(*args, **kwargs)), _flat(fast(*args, **kwargs))
    max_abs = max_rel = rel_l2 = 0.0
    mismatched = 0
    for u, v in zip(a, b):
        if u.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8):
            u, v = u.view(torch.uint8).long(), v.view(torch.uint8).long()
        uf, vf = u.double().cpu(), v.double().cpu()
        fin = torch.isfinite(uf)
        mismatched += int((uf != vf).sum()) if not u.is_floating_point() else int((~torch.isclose(uf, vf, equal_nan=True)).sum())
        if not torch.equal(fin, torch.isfinite(vf)):
            max_abs = max_rel = rel_l2 = float("inf")
            continue
        d = (uf[fin] - vf[fin]).abs()
        scale = uf[fin].abs().max().item() if fin.any() else 0.0
        ma = d.max().item() if d.numel() else 0.0
        max_abs = max(max_abs, ma)
        max_rel = max(max_rel, ma / scale if scale else ma)
        nrm = uf[fin].norm().item()
        rel_l2 = max(rel_l2, (d.norm().item() / nrm) if nrm else d.norm().item())
    return {"name": fn_name, "max_abs": max_abs, "max_rel": max_rel, "rel_l2": rel_l2,
            "mismatched_bytes": mismatched}
