"""Where the model's weights come from: one `get(name)` that returns float32, whatever the storage.

`TensorWeights` holds float tensors in memory (tests, training). `CheckpointWeights` reads a
release-layout checkpoint lazily: a tensor is read and dequantized when first asked for, kept in a
byte-bounded LRU cache, and table rows (Engram) are read by offset, never the table.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

import torch



class WeightSource(Protocol):
    def get(self, name: str) -> torch.Tensor: ...
    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor: ...
    def has(self, name: str) -> bool: ...
    def stored_dtype(self, name: str) -> str: ...


class TensorWeights:
    """Float tensors by full checkpoint name (`layers.0.attn.wq_a.weight`, ...); no scales."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtypes: dict[str, str] | None = None):
        self.tensors = tensors
        self.dtypes = dtypes or {}

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"weight '{name}' is missing") from None

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        table = self.get(name)
        return table[index.to(table.device)]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def stored_dtype(self, name: str) -> str:
        return self.dtypes.get(name, "F32")


class TensorCache:
    """A byte-bounded LRU of float tensors by name; `get(name, load)` loads on a miss.
    Thread-safe; two threads missing the same name may both load it (the second copy wins)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.held_bytes = 0
        self.loads = 0
        self._lock = threading.Lock()

    def get(self, name: str, load) -> torch.Tensor:
        with self._lock:
            hit = self._items.get(name)
            if hit is not None:
                self._items.move_to_end(name)
                return hit
        value = load(name)
        with self._lock:
            self.loads += 1
            old = self._items.pop(name, None)
            if old is not None:
                self.held_bytes -= old.numel() * old.element_size()
            self._items[name] = value
            self.held_bytes += value.numel() * value.element_size()
            while self.held_bytes > self.max_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self.held_bytes -= dropped.numel() * dropped.element_size()
        return value


class DeviceWeights:
    """A checkpoint's weights served on one device: dequantized once and kept there (the raw
    bytes the kernels read go through `reader`)."""

    def __init__(self, inner, device):
        self.inner, self.device = inner, torch.device(device)
        self.reader = inner.reader
        self._cache: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        hit = self._cache.get(name)
        if hit is None:
            hit = self._cache[name] = self.inner.get(name).to(self.device)
        return hit

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self.inner.rows(name, index.cpu()).to(self.device)

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def stored_dtype(self, name: str) -> str:
        return self.inner.stored_dtype(name)


class CheckpointWeights:
    """Lazy, dequantizing view of a release-layout checkpoint (an engine/checkpoint/reader.py reader)."""

    def __init__(self, reader, cache_bytes: int = 2 << 30):
        self.reader = reader
        self.cache = TensorCache(cache_bytes)

    def has(self, name: str) -> bool:
        return name in self.reader

    def stored_dtype(self, name: str) -> str:
        return self.reader.entry(name).dtype

    @property
    def loads(self) -> int:
        """Tensors read from disk so far (tests of laziness)."""
        return self.cache.loads

    @property
    def held_bytes(self) -> int:
        return self.cache.held_bytes

    def get(self, name: str) -> torch.Tensor:
        return self.cache.get(name, self.reader.dequantized)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Float rows of a 2-D table, read by offset (an Engram table is never read whole)."""
        flat = index.reshape(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)
        values = self.reader.dequantized_rows(name, unique)
        return values[inverse].reshape(*index.shape, -1)


def init_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A sensible random float value for a checkpoint tensor of this name (norm gains 1, biases 0,
    sinks and mHC bases O(1), mHC projections small, linears ~ N(0, 1/fan_in))."""
    leaf = name.rsplit(".", 2)
    if "norm" in name and name.endswith(".weight") and len(shape) == 1:
        return torch.ones(shape)
    if name.endswith((".bias", ".bias_vl")):
        return torch.zeros(shape)
    if name.endswith("_scale") and "hc_" in name:
        return torch.ones(shape)
    if name.endswith("_base") or name.endswith("attn_sink"):
        return 0.5 * torch.randn(shape, generator=generator)
    if "hc_" in name and name.endswith("_fn"):
        return 0.02 * torch.randn(shape, generator=generator)
    if leaf[-1] in ("q_weight", "k_weight") or len(shape) == 1:
        return torch.ones(shape)
    fan_in = shape[-1]
    return torch.randn(shape, generator=generator) / fan_in ** 0.5


def random_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float tensors for every weight of the layout (scales are implied), e.g. for tests."""
    from .layout import tensor_specs

    g = torch.Generator().manual_seed(seed)
    return {s.name: init_weight(s.name, tuple(s.logical_shape), g)
            for s in tensor_specs(cfg) if s.part == "weight" and s.group not in ("vision",)}
