"""DeepSeekMoE with sqrt-softplus scores and two correction biases (text / image tokens).

The bias only picks the experts; the weights come from the unbiased scores, normalized over the
chosen experts and scaled by `route_scale`. Routed experts are fetched only when a token picks them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig


def top_experts(biased: torch.Tensor, k: int) -> torch.Tensor:
    """The router's choice: each token's k highest biased scores' experts, highest first (torch.topk)."""
    return biased.topk(k, dim=-1).indices


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, bias_vl: torch.Tensor | None,
          image_mask: torch.Tensor | None, topk: int, route_scale: float, score_func: str = "sqrtsoftplus",
          project=None, pick=None):
    """x: [T, dim] -> (scores [T, E], experts [T, k], weights [T, k]); project(x, w): the float32 x @ w^T
    (engine/ops f32_linear; None: the plain product); pick(biased, k): the k best experts per token, highest
    first (engine/ops route_topk; None: top_experts)."""
    logits = x.float() @ gate_w.float().t() if project is None else project(x, gate_w)
    if score_func == "softmax":
        scores = logits.softmax(-1)
    elif score_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    b = bias.float().expand_as(scores)
    if image_mask is not None and bias_vl is not None:
        b = torch.where(image_mask[:, None], bias_vl.float()[None, :], b)
    experts = (pick or top_experts)(scores + b, topk)
    weights = scores.gather(1, experts)
    if topk > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return scores, experts, weights * route_scale


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The clamps come from training: the gate branch only from above, the up branch both sides."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def routed_experts(cfg: ModelConfig, prefix: str, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                   get, linear, owned: tuple[int, int] | None = None, *, act, gemm) -> torch.Tensor:
    """sum_e w_e Expert_e(x) over each token's chosen experts. The (token, expert) slots are sorted
    by expert, so each expert multiplies one contiguous run of rows: no padding, no wasted rows.
    Only the chosen experts' weights are fetched.
    owned (expert parallel): only the slots whose expert is in [start, stop) count.
    act (engine/ops): how each GEMM's output and the weighted SwiGLU output are stored (bf16 in the
    reference's numerics); the sum over a token's experts stays fp32. gemm (engine/ops): x @ w^T in the
    numerics' order of sums."""
    T, k = experts.shape
    slot_experts, slot_weights = experts.flatten(), weights.flatten()   # [T*k]
    slot_token = torch.arange(T * k, device=x.device) // k
    if owned is not None:
        mine = (slot_experts >= owned[0]) & (slot_experts < owned[1])
        slot_experts, slot_weights, slot_token = slot_experts[mine], slot_weights[mine], slot_token[mine]
        if slot_experts.numel() == 0:
            return torch.zeros(T, cfg.dim, device=x.device)
    order = torch.argsort(slot_experts, stable=True)
    token, slot_weights = slot_token[order], slot_weights[order]
    used, counts = torch.unique_consecutive(slot_experts[order], return_counts=True)
    runs = [(e, stop - n, stop) for e, stop, n in zip(used.tolist(), torch.cumsum(counts, 0).tolist(),
                                                      counts.tolist())]
    xq = linear(x, None)  # the activation as the FP4 GEMM sees it (E4M3 per 32), once for all experts
    inter = cfg.moe_inter_dim
    # one expert at a time: its rows are gathered and multiplied while still in cache, and only its
    # weights are held (stacking every used expert's would take ~17 GB per GPU at release size)
    gate_up = act(torch.cat([gemm(xq.index_select(0, token[a:b]), torch.cat([get(f"{prefix}experts.{e}.w1.weight"),
                                                                              get(f"{prefix}experts.{e}.w3.weight")]))
                             for e, a, b in runs]))
    h = swiglu(gate_up[:, :inter], gate_up[:, inter:], cfg.swiglu_limit)
    h = linear(act(h * slot_weights.unsqueeze(-1)), None)
    y = torch.zeros(T, cfg.dim, device=x.device, dtype=h.dtype)
    for e, a, b in runs:
        y.index_add_(0, token[a:b], act(gemm(h[a:b], get(f"{prefix}experts.{e}.w2.weight"))))
    return y


class Gate:
    """The router of one layer: a score per expert (sqrt(softplus) of x W_gate^T in the release), the
    top-k chosen on score + bias (bias_vl at image positions), and the chosen scores renormalized and
    scaled by route_scale. The bias only steers the choice; the weights are the plain scores."""

    def __init__(self, cfg: ModelConfig, prefix: str, get, n_active: int, project=None, pick=None):
        self.cfg, self.prefix, self.get, self.n_active = cfg, prefix, get, n_active
        self.project, self.pick = project, pick

    def __call__(self, x: torch.Tensor, image_mask: torch.Tensor | None):
        """x [T, dim] -> (scores [T, E], experts [T, k], weights [T, k])."""
        cfg, p = self.cfg, self.prefix
        bias_vl = self.get(p + "gate.bias_vl") if image_mask is not None else None
        return route(x, self.get(p + "gate.weight"), self.get(p + "gate.bias"), bias_vl, image_mask, self.n_active,
                     cfg.route_scale, cfg.score_func, self.project, self.pick)


class MoE:
    """One layer's FFN: each token's top-k routed experts (FP4 in the release), weighted by the gate,
    plus one shared expert every token takes. `linear(x, name)` is the model's quantized GEMM;
    parallel (engine/serve/parallel.py): each rank adds its own experts' share, then all_reduce;
    ops (engine/ops): the numerics and the routed experts' op, chosen once by the model."""

    def __init__(self, cfg: ModelConfig, layer: int, get, linear, ops, parallel=None):
        self.cfg, self.layer, self.get, self.linear, self.parallel, self.ops = cfg, layer, get, linear, parallel, ops
        self.prefix = f"layers.{layer}.ffn." if layer < cfg.n_layers else f"mtp.{layer - cfg.n_layers}.ffn."
        self.n_routed, n_active = cfg.experts_of(layer)
        # the gate a float32 GEMM in the reference; the choice on the kernel ops' top-k where they take it
        self.gate = Gate(cfg, self.prefix, get, n_active, ops.f32_linear, ops.route_topk)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None, probe: dict | None) -> torch.Tensor:
        """x [T, dim] (normalized) -> [T, dim]; probe (a dict, or None) receives the routing."""
        cfg, ops, linear = self.cfg, self.ops, self.linear
        scores, experts, weights = self.gate(x, image_mask)
        if self.parallel is None:
            y = ops.routed_experts(cfg, self.layer, self.prefix, x, experts, weights, self.get, linear)
        else:
            owned = self.parallel.split(self.n_routed, "routed experts")
            y = self.parallel.all_reduce(ops.routed_experts(cfg, self.layer, self.prefix, x, experts, weights,
                                                            self.get, linear, owned))
        shared = self.prefix + "shared_experts."
        # narrow: the kernel ops' SwiGLU and sum read the GEMMs' bf16 outputs as they are (no widening copies)
        h = ops.swiglu(linear(x, shared + "w1", narrow=True), linear(x, shared + "w3", narrow=True), cfg.swiglu_limit)
        y = ops.add(y, linear(h, shared + "w2", narrow=True))
        if probe is not None:
            probe["experts"], probe["weights"], probe["scores"] = experts, weights, scores
        return y
