"""One layer of the forward (the reference's Block): [Engram] -> mHC collapse -> RMSNorm -> attention ->
mHC update and collapse -> RMSNorm -> MoE -> mHC update."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..roles import LayerRole
from .attention import Attention, LayerWeights, Shared
from .graphs import called
from .mhc import MHC
from .moe import MoE


class Block:
    """A layer: its attention (engine/model/attention.py), its MoE, the mHC around both, and its Engram
    where the config places one. The stream is x [T, hc, dim]; `pre` [T, hc] is the previous
    sub-layer's collapse weights (mHC's one-step lag). Probes: a plain dict per layer, filled when given."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, get, linear, ops, parallel=None, engram=None):
        L = role.layer
        self.cfg, self.layer, self.get, self.ops = cfg, L, get, ops
        self.attn = Attention(cfg, role, LayerWeights(get, f"layers.{L}."),
                              lambda x, n, **kw: linear(x, f"layers.{L}.{n}", **kw), ops, parallel)
        self.ffn = MoE(cfg, L, get, linear, ops, parallel)
        self.hc = MHC(cfg, L, get, ops)
        self.engram = engram  # engine/model/engram.py Engram, or None

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The sub-layer's input norm; narrow: the kernel ops may hand it on as bf16 (every reader of a block's
        normalized input widens what it loads, or takes bf16)."""
        return self.ops.rms_norm(x, self.get(f"layers.{self.layer}.{name}.weight"), self.cfg.norm_eps, narrow=True)

    def mix_in(self, x: torch.Tensor, pre: torch.Tensor):
        """The attention's side of the mHC: the stream collapsed and normalized -> (the attention's input
        [T, dim], its pre, post, comb)."""
        attn_in, a_pre, a_post, a_comb = self.hc.before_attention(x, pre)
        return self._norm(attn_in, "attn_norm"), a_pre, a_post, a_comb

    def ffn_half(self, x: torch.Tensor, y: torch.Tensor, a_pre: torch.Tensor, a_post: torch.Tensor,
                 a_comb: torch.Tensor, image_mask: torch.Tensor | None, route_probe: dict | None):
        """Everything after the attention's output y: the mHC update and collapse, RMSNorm, MoE, the mHC update
        -> (the stream after the block, the FFN's pre, post, comb)."""
        x1, ffn_in, f_pre, f_post, f_comb = self.hc.before_ffn(x, y, (a_pre, a_post, a_comb))
        y = self.ffn.forward(self._norm(ffn_in, "ffn_norm"), image_mask, route_probe)
        return self.hc.after_ffn(x1, y, f_post, f_comb), f_pre, f_post, f_comb

    def forward(self, x: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor, shared: Shared, tokens,
                image_mask: torch.Tensor | None, probe: dict | None, after_attention=None, pieces=None):
        """-> (the stream after the block, the FFN's pre for the next collapse). tokens: (ids, dead,
        history[, the Engram's rows looked up already: Engram.lookup]) for the Engram; after_attention():
        called once the attention (the only part that reads or writes caches) is done
        (engine/run/pipeline.py); pieces(layer, name, method, *args): runs the parts without caches (`mix_in`,
        `ffn_half`, the attention's `queries`, `window_entries` and `output`, the indexer's `queries`;
        engine/model/graphs.py replays them as CUDA graphs); default: a plain call."""
        run = pieces or called
        if self.engram is not None:
            x = self.engram.forward(x, *tokens)
        attn_in, a_pre, a_post, a_comb = run(self.layer, "mix_in", self.mix_in, x, pre)
        attn_probe = {} if probe is not None else None
        y = self.attn.forward(attn_in, positions, shared, attn_probe, pieces)
        if after_attention is not None:
            after_attention()
        route_probe = {} if probe is not None else None
        x2, f_pre, f_post, f_comb = run(self.layer, "ffn_half", self.ffn_half, x, y, a_pre, a_post, a_comb,
                                        image_mask, route_probe)
        if probe is not None:
            probe.update(attn_probe)
            probe["routing"] = route_probe
            probe["mhc"] = {"attn": {"pre": a_pre, "post": a_post, "comb": a_comb},
                            "ffn": {"pre": f_pre, "post": f_post, "comb": f_comb}}
        return x2, f_pre
