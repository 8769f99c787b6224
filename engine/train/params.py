"""The trainable weights: float32 parameters under the checkpoint's names (routed experts stacked
per layer and part), the routing biases, initialization and export."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..checkpoint.layout import tensor_specs
from ..checkpoint.reader import CheckpointReader

EXPERT_PARTS = ("w1", "w2", "w3")


def init_params(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 initial values of every weight in the layout (scales and routing biases excluded).
    Routed experts are stacked per layer: `layers.L.ffn.experts.wX` [E, out, in]."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    hc = cfg.hc_mult
    depth_scale = (2 * cfg.n_layers) ** -0.5  # output projections: keep the residual growth bounded
    for spec in tensor_specs(cfg):
        name, shape = spec.name, spec.logical_shape
        if spec.part == "scale" or name.endswith(("gate.bias", "gate.bias_vl")):
            continue
        if spec.expert is not None:
            stacked = f"layers.{spec.layer}.ffn.experts.{name.split('.')[-2]}"
            if stacked not in out:
                scale = shape[1] ** -0.5 * (depth_scale if stacked.endswith("w2") else 1.0)
                out[stacked] = torch.randn((cfg.n_routed_experts, *shape), generator=gen) * scale
            continue
        if name.endswith(("norm.weight", "q_weight", "k_weight")) or name.endswith("_scale"):
            value = torch.ones(shape)
        elif name.endswith("attn_sink"):
            value = torch.zeros(shape)
        elif name.endswith("_base"):
            # pre and post at sigmoid(0); comb close to the identity (each copy mostly keeps itself)
            value = torch.zeros(shape)
            value[2 * hc:] = (torch.eye(hc) * 4.0).flatten()
        elif name.endswith("_fn"):
            value = torch.randn(shape, generator=gen) * 0.02 * shape[1] ** -0.5
        elif name == "embed.weight":
            value = torch.randn(shape, generator=gen)
        elif name.endswith("engram.embed.weight"):
            value = torch.randn(shape, generator=gen) * 0.5
        else:
            value = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
            if name.endswith(("wo_b.weight", "shared_experts.w2.weight")):
                value = value * depth_scale
        out[name] = value
    return out


class Trainee:
    """Parameters (nn.Parameter, float32) and routing biases (plain tensors, updated by the
    balancing rule), looked up by checkpoint name with `get`."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device, seed: int = 0,
                 values: dict[str, torch.Tensor] | None = None):
        self.cfg = cfg
        values = values if values is not None else init_params(cfg, seed)
        self.params = {k: torch.nn.Parameter(v.float().to(device)) for k, v in values.items()}
        self.biases = {f"layers.{L}.ffn.gate.bias": torch.zeros(cfg.n_routed_experts, device=device)
                       for L in range(cfg.n_layers)}

    def get(self, name: str) -> torch.Tensor:
        got = self.params.get(name)
        return got if got is not None else self.biases[name]

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: dict[str, torch.Tensor], device="cpu") -> "Trainee":
        """From checkpoint-named float tensors (per-expert names), e.g. a dequantized checkpoint."""
        values, biases = {}, {}
        for name, t in tensors.items():
            if ".ffn.gate.bias" in name:
                biases[name] = t
            elif ".ffn.experts." in name:
                continue
            else:
                values[name] = t
        for L in range(cfg.n_layers):
            for part in EXPERT_PARTS:
                values[f"layers.{L}.ffn.experts.{part}"] = torch.stack(
                    [tensors[f"layers.{L}.ffn.experts.{e}.{part}.weight"] for e in range(cfg.n_routed_experts)])
        trainee = cls(cfg, device, values=values)
        for name, b in biases.items():
            if name in trainee.biases:
                trainee.biases[name] = b.float().to(device)
        return trainee

    @classmethod
    def from_checkpoint(cls, cfg: ModelConfig, path, device="cpu") -> "Trainee":
        """From a checkpoint in the release layout, its weights dequantized to float32 (a run that
        continues training an exported model starts from exactly what the engine serves)."""
        reader = CheckpointReader(Path(path), cfg)
        tensors = {s.name: reader.dequantized(s.name).float() for s in tensor_specs(cfg) if s.part != "scale"}
        return cls.from_tensors(cfg, tensors, device)

    def decay_groups(self) -> tuple[list, list]:
        """(matrices with weight decay, the rest: embeddings, Engram tables, vectors)."""
        decay, rest = [], []
        for name, p in self.params.items():
            (decay if p.dim() >= 2 and "engram.embed" not in name and name != "embed.weight" else rest).append(p)
        return decay, rest

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """Float CPU tensors by checkpoint name (logical shapes), for `write_checkpoint`."""
        out = {}
        for name, p in self.params.items():
            p = p.detach().float().cpu()
            if ".ffn.experts." in name:
                layer, part = name.split(".")[1], name.split(".")[-1]
                for e in range(self.cfg.n_routed_experts):
                    out[f"layers.{layer}.ffn.experts.{e}.{part}.weight"] = p[e].clone()
            else:
                out[name] = p
        for name, b in self.biases.items():
            out[name] = b.detach().float().cpu()
            if self.cfg.vision_enabled:  # no image positions in training: bias_vl is the text bias
                out[name + "_vl"] = out[name].clone()
        return out
