"""Single-pass mHC: the residual stream is `hc_mult` copies, mixed around every sub-layer.

Each sub-layer computes (pre, post, comb) from the stream entering it. `post` and `comb` write its
output back; `pre` is NOT used to collapse its own input but the NEXT sub-layer's (one-step lag),
so one fused kernel can do the update, the mix and the next coefficients in a single read.
"""

from __future__ import annotations

import torch


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[T, n, n] logits -> a (nearly) doubly-stochastic mix: row softmax (+eps), then columns,
    then `iters - 1` more rounds of rows-then-columns. The last step is on columns, so columns sum
    to 1 and rows only approximately."""
    comb = torch.softmax(logits, dim=-1) + eps
    # the rounds run on [n, n, T]: each sum over n then adds whole rows of T values (~3x faster)
    comb = comb.permute(1, 2, 0).contiguous()
    if comb.requires_grad:  # training: out of place, for autograd
        comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    else:  # the same arithmetic in place: no [n, n, T] allocation per step
        comb.div_(comb.sum(dim=0, keepdim=True).add_(eps))
        for _ in range(iters - 1):
            comb.div_(comb.sum(dim=1, keepdim=True).add_(eps))
            comb.div_(comb.sum(dim=0, keepdim=True).add_(eps))
    return comb.permute(2, 0, 1).contiguous()


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last axis, keepdim (one pass: vector_norm)."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() / x.shape[-1] + eps)


def mix_logits(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
               hc: int, hc_eps: float, norm_eps: float):
    """x: [T, hc, dim]; fn: [(2+hc)*hc, hc*dim]; scale: [3]; base: [(2+hc)*hc].
    Returns pre [T, hc], post [T, hc] and comb's logits [T, hc, hc] (before the Sinkhorn rounds)."""
    flat = x.flatten(1).float()  # normalized over the whole flattened stream, one statistic per token
    m = (flat @ fn.float().t()) * inverse_rms(flat, norm_eps)
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    return pre, post, (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             hc: int, iters: int, hc_eps: float, norm_eps: float):
    """pre [T, hc], post [T, hc], comb [T, hc, hc] (comb[i, j]: from copy i into copy j); see mix_logits."""
    pre, post, logits = mix_logits(x, fn, scale, base, hc, hc_eps, norm_eps)
    return pre, post, sinkhorn(logits, iters, hc_eps)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, hc, dim] x [T, hc] -> [T, dim]."""
    return torch.bmm(pre.unsqueeze(1).to(x.dtype), x).squeeze(1)


def expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New stream X'[j] = post[j] * y + sum_i comb[i, j] * X[i]. y: [T, dim]; residual: [T, hc, dim]."""
    # baddbmm, not bmm + add: it gives the same bits for 1 token as for many (prefill == decode);
    # in place on the post * y product, which saves copying it
    return (post.unsqueeze(-1) * y.unsqueeze(1)).baddbmm_(comb.transpose(1, 2), residual)


class MHC:
    """mHC around one block: the stream x [T, hc, dim] is collapsed into the attention's input, updated
    by the attention's output and collapsed into the FFN's input, then updated by the FFN's output.
    Each sub-layer's mixes (pre, post, comb) come from the stream entering it; its `pre` collapses the
    NEXT sub-layer's input (the one-step lag above). The arithmetic is the numerics' (engine/ops), which
    may fuse an update with the next collapse and mixes (the Triton kernel)."""

    def __init__(self, cfg, layer: int, get, ops):
        self.layer, self.get, self.ops = layer, get, ops
        self.prefix = f"layers.{layer}."
        self.args = (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def _weights(self, part: str):
        p = self.prefix
        return self.get(f"{p}hc_{part}_fn"), self.get(f"{p}hc_{part}_scale"), self.get(f"{p}hc_{part}_base")

    def before_attention(self, x: torch.Tensor, pre: torch.Tensor):
        """-> (the attention's input [T, dim], its pre, post, comb); pre: the previous sub-layer's."""
        return self.ops.mhc_attention(self.layer, x, pre, *self._weights("attn"), *self.args)

    def before_ffn(self, x: torch.Tensor, y: torch.Tensor, mixes):
        """The stream updated by the attention's output y with its mixes -> (stream, the FFN's input,
        the FFN's pre, post, comb)."""
        return self.ops.mhc_ffn(self.layer, x, (y, *mixes), *self._weights("ffn"), *self.args)

    def after_ffn(self, x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return self.ops.expand(y, x, post, comb)
