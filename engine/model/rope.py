"""Rotary embeddings on the LAST `rope_head_dim` dims, adjacent pairs taken as complex numbers.

Layers with global KV (ratio > 0) rotate at `compress_rope_theta` with YaRN; window-only layers at
`rope_theta` without it. The attention output is rotated back (inverse) so the cache keeps one form.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..config import ModelConfig


@lru_cache(maxsize=16)
def _inv_freqs(rope_dim: int, base: float, original_seq_len: int, factor: float,
               beta_fast: int, beta_slow: int) -> torch.Tensor:
    """Per-pair angular frequencies [rope_dim/2], YaRN-corrected when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def dim_for(rotations: float) -> float:
            # the dim whose wavelength turns `rotations` times over the training context
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_for(beta_fast)), 0)
        high = min(math.ceil(dim_for(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1: high-frequency dims keep their frequency; 0: divided by factor
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


def layer_freqs(cfg: ModelConfig, compress_ratio: int) -> torch.Tensor:
    """The frequency vector a layer uses: YaRN at compress_rope_theta for ratio > 0."""
    if compress_ratio > 0:
        return _inv_freqs(cfg.rope_head_dim, float(cfg.compress_rope_theta), cfg.original_seq_len,
                          float(cfg.rope_factor), cfg.beta_fast, cfg.beta_slow)
    return _inv_freqs(cfg.rope_head_dim, float(cfg.rope_theta), 0, 1.0, cfg.beta_fast, cfg.beta_slow)


def rotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last len(freqs)*2 dims of x. x: [T, ..., D]; positions: [T] (int)."""
    rd = freqs.numel() * 2
    angles = positions.to(torch.float32)[:, None] * freqs.to(x.device)[None, :]  # [T, rd/2]
    if inverse:
        angles = -angles
    cos, sin = torch.cos(angles), torch.sin(angles)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    pairs = x[..., -rd:].unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = x.clone()  # the untouched head, then each pair written in place of its old value
    out_pairs = out[..., -rd:].unflatten(-1, (-1, 2))
    out_pairs[..., 0] = re * cos - im * sin
    out_pairs[..., 1] = re * sin + im * cos
    return out
