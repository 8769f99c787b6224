"""Checkpoint I/O in the release layout: lazy tensor reads, a streaming writer and a sparse full-size
skeleton. The header-only inventory lives in `engine.inventory` (no torch) and is re-exported here.

Every problem with a folder raises `CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import torch

from . import quant
from .weights import init_weight
from .config import HF_TO_INFERENCE, ModelConfig
from .layout import WEIGHT_BLOCK, Shard, TensorSpec, shard_plan, tensor_specs
from .safe_io import open_regular
from .inventory import (  # noqa: F401  (re-exported: the header-only half of checkpoint I/O)
    CONFIG_NAME, CheckpointError, INDEX_NAME, SAFETENSORS_BYTES, TensorEntry, check_against_config, checkpoint_config,
    read_inventory)

TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "F16": torch.float16, "U8": torch.uint8}


# -- reading tensors -------------------------------------------------------------------------------

def _to_torch(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 bytes -> a torch tensor of the safetensors dtype (no copy beyond the read)."""
    t = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
    torch_dtype = TORCH_DTYPES.get(dtype)
    if torch_dtype is None:
        raise CheckpointError(f"tensor dtype {dtype} is not supported by the reader")
    if torch_dtype is not torch.uint8:
        t = t.view(torch_dtype)
    return t.reshape(shape)


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint folder; reads only the bytes asked for.

    With `cfg` (or the folder's config.json when `cfg` is None and one exists) and `validate`, the
    headers are checked against the config's layout at open time."""

    def __init__(self, directory: str | Path, cfg: ModelConfig | None = None, validate: bool = True):
        self.directory = Path(directory)
        self.inventory = read_inventory(self.directory)
        if cfg is None and (self.directory / CONFIG_NAME).exists():
            cfg = checkpoint_config(self.directory)
        self.cfg = cfg
        if validate and cfg is not None:
            problems = check_against_config(self.inventory, cfg)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise CheckpointError(f"{self.directory}: checkpoint disagrees with its config: {problems[0]}{more}")
        self._maps: dict[str, np.memmap] = {}
        self.nonfinite: list[str] = []   # weights found holding NaN or inf (warned about once)

    def __contains__(self, name: str) -> bool:
        return name in self.inventory.tensors

    def names(self) -> list[str]:
        return list(self.inventory.tensors)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.inventory.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: no tensor named '{name}'") from None

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, in its stored dtype (float8_e4m3fn, float8_e8m0fnu, int8, bfloat16, float32)."""
        e = self.entry(name)
        path = self.directory / e.shard
        buf = bytearray(e.nbytes)
        f, _ = open_regular(path, "shard file", CheckpointError)
        try:
            with f:
                f.seek(e.begin)
                got = f.readinto(buf)
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({err.strerror})") from None
        if got != e.nbytes:
            raise CheckpointError(f"{path}: truncated while reading tensor '{name}'")
        return _to_torch(np.frombuffer(buf, dtype=np.uint8), e.dtype, e.shape)

    __getitem__ = tensor

    def _rows_map(self, name: str) -> np.memmap:
        m = self._maps.get(name)
        if m is None:
            e = self.entry(name)
            if len(e.shape) != 2:
                raise CheckpointError(f"{self.directory}: read_rows needs a 2-D tensor, '{name}' is {list(e.shape)}")
            row_bytes = e.shape[1] * SAFETENSORS_BYTES[e.dtype]
            m = np.memmap(self.directory / e.shard, dtype=np.uint8, mode="r", offset=e.begin,
                          shape=(e.shape[0], row_bytes))
            self._maps[name] = m
        return m

    def read_rows(self, name: str, rows: Iterable[int] | torch.Tensor | np.ndarray) -> torch.Tensor:
        """Only the given rows of a 2-D tensor: [*rows.shape, cols] in the stored dtype."""
        e = self.entry(name)
        idx = np.asarray(rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= e.shape[0]):
            raise CheckpointError(f"{self.directory}: row index outside 0..{e.shape[0] - 1} for '{name}'")
        raw = self._rows_map(name)[idx.reshape(-1)]
        return _to_torch(raw, e.dtype, tuple(idx.shape) + (e.shape[1],))

    def _scale_name(self, name: str) -> str | None:
        scale = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        return scale if scale in self.inventory.tensors else None

    def _resolve(self, name: str) -> str:
        if name not in self.inventory.tensors and name + ".weight" in self.inventory.tensors:
            return name + ".weight"
        return name

    def dequantized(self, name: str) -> torch.Tensor:
        """float32 values of a weight: FP8 with its 32x32 (or per-row 1x32) E8M0 scales, FP4 (I8 packed)
        with its E8M0 scale per 32 inputs; BF16/F32 are just widened."""
        name = self._resolve(name)
        w = self.tensor(name)
        scale_name = self._scale_name(name)
        if scale_name is None:
            return self._checked(name, w.float())
        return self._checked(name, _dequantize(w, self.tensor(scale_name), name))

    def dequantized_rows(self, name: str, rows) -> torch.Tensor:
        """float32 rows of a per-row-scaled FP8 table (the Engram embeddings)."""
        name = self._resolve(name)
        w = self.read_rows(name, rows)
        scale_name = self._scale_name(name)
        if scale_name is None:
            return self._checked(name, w.float())
        s = self.read_rows(scale_name, rows)
        return self._checked(name, quant.dequantize_fp8(w, s, w.shape[-1] // s.shape[-1]))

    def _checked(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """`values`, after one pass for NaN/inf (cheap beside the read and the dequantization): such a
        weight makes every result NaN, so say which, once per checkpoint (`nonfinite` lists them all)."""
        if values.is_floating_point() and not bool(torch.isfinite(values).all()):
            if name not in self.nonfinite:
                self.nonfinite.append(name)
            if len(self.nonfinite) == 1:
                warnings.warn(f"{self.directory}: weight '{name}' holds NaN or infinite values; results computed "
                              "from this checkpoint (norms, scores, routing) will be NaN", RuntimeWarning,
                              stacklevel=3)
        return values

    def close(self) -> None:
        self._maps.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dequantize(w: torch.Tensor, s: torch.Tensor, name: str) -> torch.Tensor:
    if w.dtype == torch.int8:
        return quant.dequantize_fp4_weight(w, s, w.shape[-1] * 2 // s.shape[-1])
    if w.dtype == torch.float8_e4m3fn:
        if w.dim() == 2 and tuple(s.shape) == (w.shape[0], w.shape[1] // WEIGHT_BLOCK) and w.shape[0] > 1:
            return quant.dequantize_fp8(w, s, WEIGHT_BLOCK)          # per-row groups (Engram tables)
        return quant.dequantize_fp8_weight(w, s, WEIGHT_BLOCK)       # 32x32 blocks
    raise CheckpointError(f"tensor '{name}' of dtype {w.dtype} has a scale but no known format")


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
