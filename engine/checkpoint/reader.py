"""Reading a checkpoint in the release layout: lazy tensor reads (only the bytes asked for), FP8/FP4
weights dequantized with their scales. The header-only inventory is engine/checkpoint/inventory.py
(no torch); writing is writer.py.

Every problem with a folder raises `CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from .. import quant
from ..config import ModelConfig
from ..safe_io import open_regular
from .inventory import (CONFIG_NAME, SAFETENSORS_BYTES, CheckpointError, TensorEntry, check_against_config,
                        checkpoint_config, read_inventory)
from .layout import WEIGHT_BLOCK

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
