"""Writing a checkpoint in the release layout: a streaming writer (tensors encoded to their stored
formats shard by shard) and a sparse full-size skeleton (headers only), with the root config.json."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Mapping

import torch

from .. import quant
from ..config import HF_TO_INFERENCE, ModelConfig
from .inventory import CONFIG_NAME, INDEX_NAME, CheckpointError
from .layout import WEIGHT_BLOCK, Shard, TensorSpec, shard_plan, tensor_specs
from .reader import TORCH_DTYPES
from .weights import init_weight


# -- writing ---------------------------------------------------------------------------------------

def _header_bytes(specs: list[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # keep the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


_INFERENCE_TO_HF = {v: k for k, v in HF_TO_INFERENCE.items()}


def config_json(cfg: ModelConfig) -> dict:
    """The checkpoint-root config.json: HF names under text_config, the vision tower under
    vision_config, the weight format under quantization_config. `load_config` reads it back equal."""
    text: dict = {}
    vision: dict = {}
    for key, value in cfg.to_dict().items():
        if key in ("dtype", "image_token_id"):
            continue
        if key.startswith("vision_"):
            vision[key] = value
        else:
            text[_INFERENCE_TO_HF.get(key, key)] = value
    text["norm_topk_prob"] = True
    text["rope_scaling"] = {"type": "yarn", "factor": cfg.rope_factor,
                            "original_max_position_embeddings": cfg.original_seq_len,
                            "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow}
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "image_token_id": cfg.image_token_id,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3" if cfg.dtype == "fp8" else cfg.dtype,
                                "scale_fmt": "ue8m0", "weight_block_size": [WEIGHT_BLOCK, WEIGHT_BLOCK],
                                "activation_scheme": "dynamic"},
        "text_config": text,
        "vision_config": vision,
    }


def _write_index_and_config(cfg: ModelConfig, out: Path, plan: list[Shard]) -> None:
    index = {"metadata": {"total_size": sum(sh.nbytes for sh in plan)},
             "weight_map": {s.name: sh.filename for sh in plan for s in sh.specs}}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1))
    (out / CONFIG_NAME).write_text(json.dumps(config_json(cfg), indent=2))


def _prepare_out(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"{out}: cannot create the output folder ({err.strerror})") from None
    return out


def write_skeleton(cfg: ModelConfig, out_dir: str | Path, n_shards: int | None = None) -> Path:
    """The full layout with every data region a hole: real headers, sparse files of the full size."""
    out = _prepare_out(out_dir)
    plan = shard_plan(cfg, n_shards)
    for shard in plan:
        head = _header_bytes(shard.specs)
        with open(out / shard.filename, "wb") as f:
            f.write(head)
            f.truncate(len(head) + shard.nbytes)
    _write_index_and_config(cfg, out, plan)
    return out


def _encode(spec: TensorSpec, scale: TensorSpec | None, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logical float values -> (stored weight, stored scale) per the layout's dtype."""
    if spec.dtype == "I8":
        return quant.quantize_fp4_weight(value, WEIGHT_BLOCK)
    if spec.dtype == "F8_E4M3":
        if scale is not None and scale.shape == (spec.shape[0], spec.shape[1] // WEIGHT_BLOCK) and spec.shape[0] > 1 \
                and spec.kind.endswith("engram.embed"):
            return quant.quantize_fp8(value, WEIGHT_BLOCK)
        if scale is None:
            return quant.to_e4m3(value), None
        return quant.quantize_fp8_weight(value, WEIGHT_BLOCK)
    return value.to(TORCH_DTYPES[spec.dtype]), None


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_checkpoint(cfg: ModelConfig, out_dir: str | Path, tensors: Mapping[str, torch.Tensor] | None = None,
                     seed: int = 0, n_shards: int | None = None) -> Path:
    """Save a config's weights in the release layout, one tensor at a time.

    `tensors` maps checkpoint names ("layers.0.attn.wq_a.weight") to either float values of the logical
    shape (quantized here per the layout: FP8 with 32x32 E8M0 scales, FP4 with E8M0 per 32) or already
    stored values (matching dtype and stored shape; then the scale must be given too). Missing ones are
    random-initialized from `seed`."""
    tensors = dict(tensors or {})
    specs = tensor_specs(cfg)
    known = {s.name: s for s in specs}
    for name in tensors:
        if name not in known:
            raise CheckpointError(f"write_checkpoint: tensor '{name}' is not in the config's layout")
    out = _prepare_out(out_dir)
    plan = shard_plan(cfg, n_shards, specs)
    gen = torch.Generator().manual_seed(seed)
    for shard in plan:
        with open(out / shard.filename, "wb") as f:
            f.write(_header_bytes(shard.specs))
            pending: dict[str, torch.Tensor] = {}
            for spec in shard.specs:
                if spec.name in pending:            # a scale produced with its weight
                    data = pending.pop(spec.name)
                else:
                    data = _produce(spec, known, tensors, gen, pending)
                if tuple(data.shape) != spec.shape or data.dtype != TORCH_DTYPES[spec.dtype]:
                    raise CheckpointError(f"write_checkpoint: tensor '{spec.name}' is {data.dtype} "
                                          f"{list(data.shape)}, the layout needs {spec.dtype} {list(spec.shape)}")
                f.write(_raw(data))
    _write_index_and_config(cfg, out, plan)
    return out


def _produce(spec: TensorSpec, known: dict[str, TensorSpec], tensors: dict[str, torch.Tensor],
             gen: torch.Generator, pending: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stored bytes of `spec` (and, for a quantized weight, its scale into `pending`)."""
    scale_name = spec.name[: -len(".weight")] + ".scale" if spec.name.endswith(".weight") else None
    scale = known.get(scale_name) if scale_name else None
    given = tensors.get(spec.name)
    stored = TORCH_DTYPES[spec.dtype]
    if given is not None and given.dtype == stored and tuple(given.shape) == spec.shape:
        if scale is not None:
            if scale_name not in tensors:
                raise CheckpointError(f"write_checkpoint: '{spec.name}' is given already quantized, "
                                      f"so '{scale_name}' must be given too")
            pending[scale_name] = tensors[scale_name]
        return given
    if spec.part == "scale":
        raise CheckpointError(f"write_checkpoint: scale '{spec.name}' given without its quantized weight")
    if given is not None:
        if tuple(given.shape) != spec.logical_shape:
            raise CheckpointError(f"write_checkpoint: tensor '{spec.name}' has shape {list(given.shape)}, "
                                  f"the layout needs {list(spec.logical_shape)}")
        value = given.float()
    else:
        value = init_weight(spec.name, tuple(spec.logical_shape), gen)
    data, scale_data = _encode(spec, scale, value)
    if scale is not None:
        pending[scale_name] = scale_data
    return data
