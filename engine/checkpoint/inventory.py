"""Header-only inventory of a checkpoint in the release layout: what tensors each shard holds, with
dtypes, shapes and byte ranges, read from the safetensors headers and the index (no tensor data, no
torch: the app's tally and the CLI's `inspect` need only this).

A safetensors shard is: 8 bytes little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the data; the
offsets are relative to the end of the header. We parse headers ourselves and never map whole files
(the two Engram shards are 101.5 GB each).

Every problem with a folder raises `CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import gc
import json
import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..config import ModelConfig, load_config
from .layout import TensorSpec, spec_from_header, tensor_specs
from ..safe_io import open_regular, read_bytes

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# every safetensors dtype (so a foreign checkpoint is inventoried, then flagged by check_against_config)
SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
                     "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors limit
MAX_INDEX = 256 * 1024 * 1024   # the release's index is ~10 MB

try:  # optional: a faster JSON parser when the environment has one (same results)
    import orjson as _orjson
    _loads = _orjson.loads
except ImportError:  # pragma: no cover
    _loads = json.loads


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be read; the message names the file and the problem."""


class TensorEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: str
    begin: int   # absolute byte offset of the data in the shard file
    end: int


@dataclass
class ShardInfo:
    filename: str
    size: int          # apparent file size
    header_len: int
    n_tensors: int
    data_bytes: int


@dataclass
class Inventory:
    """What a checkpoint folder holds, from its headers alone."""

    directory: Path
    tensors: dict[str, TensorEntry]
    shards: list[ShardInfo]
    index_total_size: int | None = None
    extra_in_shards: list[str] = field(default_factory=list)   # in a shard but not in the index

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def specs(self) -> list[TensorSpec]:
        """The tensors as layout `TensorSpec`s (what the tally consumes)."""
        return [spec_from_header(t.name, t.dtype, t.shape) for t in self.tensors.values()]

    def bytes_by_dtype(self) -> dict[str, int]:
        out: Counter = Counter()
        for t in self.tensors.values():
            out[t.dtype] += t.nbytes
        return dict(sorted(out.items()))

    def count_by_dtype(self) -> dict[str, int]:
        return dict(sorted(Counter(t.dtype for t in self.tensors.values()).items()))


# -- reading headers -------------------------------------------------------------------------------

def read_header(path: Path) -> tuple[int, dict, int]:
    """(header length, parsed header, file size) of one shard, validating the framing. Regular files
    only (a FIFO or a device named as a shard would block or never end); reads only the header."""
    f, size = open_regular(path, "shard file", CheckpointError, missing="shard file is missing")
    try:
        with f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated shard ({size} bytes, shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
            if n > MAX_HEADER:
                raise CheckpointError(f"{path}: header length {n} exceeds the 100 MB safetensors limit")
            raw = f.read(n)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the shard ({err.strerror or err})") from None
    try:
        header = _loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        msg = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8" if isinstance(
            err, UnicodeDecodeError) else "nested too deeply"
        raise CheckpointError(f"{path}: malformed header JSON ({msg})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed header JSON (top level is not an object)")
    return n, header, size


def _entries(path: Path, filename: str, n: int, header: dict, size: int) -> list[TensorEntry]:
    """Validate one header's tensor entries against the file (a tight loop: 96k entries at release)."""
    base = 8 + n
    data_len = size - base
    out = []
    append, prod, itemsize = out.append, math.prod, SAFETENSORS_BYTES
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            nbytes = prod(shape) * itemsize[dtype]
            ok = 0 <= begin <= end and end - begin == nbytes and min(shape, default=0) >= 0
        except KeyError:
            if isinstance(info, dict) and "dtype" in info and info["dtype"] not in itemsize:
                raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {info['dtype']!r}") from None
            raise CheckpointError(f"{path}: malformed header entry for tensor '{name}' "
                                  "(needs dtype, shape and data_offsets [begin, end])") from None
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor '{name}' "
                                  "(needs dtype, shape and data_offsets [begin, end])") from None
        if not ok:
            raise CheckpointError(f"{path}: tensor '{name}' data_offsets {info['data_offsets']} do not hold "
                                  f"{dtype} {list(shape)} ({nbytes} bytes)")
        if end > data_len:
            raise CheckpointError(f"{path}: truncated shard or data offsets outside the file: tensor '{name}' "
                                  f"ends at data byte {end} but the file holds {max(data_len, 0)} data bytes")
        append(TensorEntry(name, dtype, shape, nbytes, filename, base + begin, base + end))
    _check_disjoint(path, out, base)
    return out


def _check_disjoint(path: Path, entries: list[TensorEntry], base: int) -> None:
    """Two tensors whose byte ranges overlap would read each other's data: refuse the shard."""
    spans = sorted((e.begin, e.end, e.name) for e in entries if e.end > e.begin)
    for (_, end_a, name_a), (begin_b, end_b, name_b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise CheckpointError(f"{path}: tensors '{name_a}' and '{name_b}' share data bytes "
                                  f"{begin_b - base}..{min(end_a, end_b) - base} (each tensor needs its own bytes)")


def _read_index(directory: Path) -> dict:
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such checkpoint folder")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a folder")
    path = directory / INDEX_NAME
    raw = read_bytes(path, "shard index", MAX_INDEX, CheckpointError,
                     missing=f"missing index (expected {INDEX_NAME} in the checkpoint folder)")
    try:
        index = _loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        msg = f"{err.msg} at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else "not UTF-8" if \
            isinstance(err, UnicodeDecodeError) else "nested too deeply"
        raise CheckpointError(f"{path}: malformed index JSON ({msg})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{path}: index has no 'weight_map' object")
    return index


def read_inventory(directory: str | Path) -> Inventory:
    """Header-only inventory of a checkpoint folder (index + every shard it names)."""
    enabled = gc.isenabled()
    gc.disable()  # ~100k small objects: the cyclic collector would rescan them many times
    try:
        return _read_inventory(Path(directory))
    finally:
        if enabled:
            gc.enable()


def _read_inventory(directory: Path) -> Inventory:
    index = _read_index(directory)
    weight_map: dict[str, str] = index["weight_map"]
    filenames = list(dict.fromkeys(weight_map.values()))
    tensors: dict[str, TensorEntry] = {}
    shards: list[ShardInfo] = []
    extra: list[str] = []
    for filename in filenames:
        if not isinstance(filename, str) or "/" in filename or filename in ("", ".", ".."):
            raise CheckpointError(f"{directory / INDEX_NAME}: bad shard file name {filename!r}")
        path = directory / filename
        n, header, size = read_header(path)
        entries = _entries(path, filename, n, header, size)
        shards.append(ShardInfo(filename, size, n, len(entries), sum(e.nbytes for e in entries)))
        for e in entries:
            if weight_map.get(e.name) != filename:
                extra.append(e.name)
            tensors[e.name] = e
    for name, filename in weight_map.items():
        entry = tensors.get(name)
        if entry is None or entry.shard != filename:
            raise CheckpointError(f"{directory / filename}: tensor '{name}' is in the index but not in this shard")
    total = (index.get("metadata") or {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
    return Inventory(directory, tensors, shards, total, extra)


def checkpoint_config(directory: str | Path) -> ModelConfig:
    """The folder's config.json (root form with text_config, or flat)."""
    path = Path(directory) / CONFIG_NAME
    if not path.exists():
        raise CheckpointError(f"{path}: missing config.json in the checkpoint folder")
    return load_config(path)


def check_against_config(inventory: Inventory, cfg: ModelConfig) -> list[str]:
    """Every difference between the folder's tensors and the config's layout (empty when they agree)."""
    expected = {s.name: s for s in tensor_specs(cfg)}
    problems = []
    for name, spec in expected.items():
        got = inventory.tensors.get(name)
        if got is None:
            problems.append(f"missing tensor {name} (expected {spec.dtype} {list(spec.shape)})")
        elif got.dtype != spec.dtype or got.shape != spec.shape:
            problems.append(f"{got.shard}: tensor {name} is {got.dtype} {list(got.shape)}, "
                            f"the config's layout says {spec.dtype} {list(spec.shape)}")
    for name, got in inventory.tensors.items():
        if name not in expected:
            problems.append(f"{got.shard}: unexpected tensor {name} ({got.dtype} {list(got.shape)}) "
                            "not in the config's layout")
    for name in inventory.extra_in_shards:
        problems.append(f"{inventory.tensors[name].shard}: tensor {name} is not listed in the index")
    return problems
