"""Inputs of the sparse attention tests, importable without the interpreter (the GPU checks run them in a
fresh process where kernels must compile)."""

from __future__ import annotations

import torch

from engine import quant as Q


def every_fp4_code_and_scale(d: int, n: int):
    """Packed FP4 rows [n, d/2] (int8) covering all 256 byte values, and E4M3 scale bytes [n, d/16] (uint8)
    covering all 254 codes but NaN."""
    packed = torch.arange(n * d // 2, dtype=torch.int64).remainder(256).to(torch.uint8)
    packed = packed[torch.randperm(packed.numel(), generator=torch.Generator().manual_seed(1))]
    packed = packed.view(n, d // 2).view(torch.int8)
    sc = torch.arange(n * d // 16, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, d // 16)
    sc = torch.where((sc & 0x7F) == 0x7F, torch.full_like(sc, 0x38), sc)  # E4M3 NaN codes -> 1.0
    assert set(sc.flatten().tolist()) >= set(range(0, 0x7F)) | set(range(0x80, 0xFF))
    return packed, sc


def attention_inputs(g, t, h, d, n, w, k, wn, q_scale=2.0):
    """[q, FP4 cache bytes, their scales, selected indices, window E4M3 bytes, their scales, window indices,
    sink] as sparse_attn_triton takes them; indices -1 are empty slots."""
    q = (torch.randn(t, h, d, generator=g) * q_scale).to(torch.bfloat16)
    kvp, kvs = Q.quantize_fp4(torch.randn(n, d, generator=g), 16, "e4m3")
    w8, ws = Q.quantize_fp8(torch.randn(w, d, generator=g))
    idx = torch.randint(-1, n, (t, k), generator=g, dtype=torch.int32)
    widx = torch.randint(-1, w, (t, wn), generator=g, dtype=torch.int32)
    sink = torch.randn(h, generator=g)
    return [q, kvp, kvs, idx, w8, ws, widx, sink]
