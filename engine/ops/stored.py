"""Weights on one device in their stored formats: the kernel path's weight source (no fp32 copies).

`StoredWeights` replaces `DeviceWeights` (engine/checkpoint/weights.py) on the GPU: each tensor is
moved to the device once in the dtype the checkpoint stores (E4M3 + E8M0 scales for the FP8 linears,
packed FP4 + E8M0 for the routed experts, BF16/F32 for the rest) and kept so. The kernels read those
bytes (`stored`, `stacked_experts`, engine/ops/triton.py). What still asks for a float value (`get`):
- a BF16/F32 weight (norms, gate, compressor, mHC, sinks: ~20 MB a release layer) is widened to
  float32 once and kept;
- an FP8/FP4 weight is dequantized on the device for that call only (not kept; remembered by its
  storage without keeping it alive, so tests can count what is still referenced: `alive`); the
  kernel ops ask for wo_a and the Engram's wkv by name and run their stored bytes instead.
Each float value made is checked once for NaN/inf by the checkpoint reader (its `nonfinite` warning).
The routed experts of a checkpoint are held once, stacked over experts (`stacked_experts`); each
expert's tensors are views of the stacks.

engine.run.api.load serves a checkpoint through StoredWeights whenever the engine runs the kernel ops
(on the CPU too, where the Triton interpreter or the kernels' references run them).

`TensorReader` is a checkpoint reader over tensors already in memory (generated weights, tests).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .. import quant

QUANTIZED = ("F8_E4M3", "I8")  # stored dtypes with a scale tensor beside them
_EXPERT_PARTS = (("w1", "weight"), ("w1", "scale"), ("w3", "weight"), ("w3", "scale"), ("w2", "weight"),
                 ("w2", "scale"))  # the order of a stack tuple
_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
                torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8", torch.uint8: "U8", torch.float16: "F16"}


class StoredEntry(NamedTuple):
    name: str
    dtype: str              # safetensors dtype name
    shape: tuple[int, ...]
    nbytes: int


class TensorReader:
    """The reader surface the kernel ops use (`name in r`, `r.entry(name).dtype`, `r.tensor(name)`,
    `r.names()`) over a dict of stored-dtype tensors. Stacked routed experts may be given whole
    (`experts[prefix] = (w1, w1_scale, w3, w3_scale, w2, w2_scale)`, each [E, ...]): expert e's
    tensors are then views of the stacks, and `stacked_experts` hands the stacks out without a copy."""

    def __init__(self, tensors: dict[str, torch.Tensor], experts: dict[str, tuple] | None = None):
        self.tensors = dict(tensors)
        self.experts = dict(experts or {})
        for prefix, stack in self.experts.items():
            for i, (w, leaf) in enumerate(_EXPERT_PARTS):
                for e in range(stack[i].shape[0]):
                    self.tensors[f"{prefix}experts.{e}.{w}.{leaf}"] = stack[i][e]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def entry(self, name: str) -> StoredEntry:
        t = self.tensors[name]
        return StoredEntry(name, _DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape), t.numel() * t.element_size())

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"weight '{name}' is missing") from None

    __getitem__ = tensor

    def stacked_experts(self, prefix: str, n_experts: int):
        stack = self.experts.get(prefix)
        return stack if stack is not None and stack[0].shape[0] == n_experts else None


def dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 value of a stored FP8 (32x32 blocks, or per-row groups of 32 for tables) or packed FP4
    weight, computed where the bytes are."""
    if w.dtype == torch.int8:
        return quant.dequantize_fp4_weight(w, scale, w.shape[-1] * 2 // scale.shape[-1])
    if w.dim() == 2 and tuple(scale.shape) == (w.shape[0], w.shape[1] // 32) and w.shape[0] > 1 \
            and scale.shape[0] != -(-w.shape[0] // 32):
        return quant.dequantize_fp8(w, scale, 32)
    return quant.dequantize_fp8_weight(w, scale, 32)


def nonfinite_checked(reader, name: str, value: torch.Tensor) -> torch.Tensor:
    """value after the reader's NaN/inf check (CheckpointReader's `_checked`: warned once, listed in
    `nonfinite`), where the reader has one."""
    check = getattr(reader, "_checked", None)
    return check(name, value) if check is not None else value


class HandedOut:
    """Float values made from stored FP8/FP4 bytes, remembered by their storage (not kept alive): `alive`
    counts those still referenced somewhere."""

    def __init__(self):
        self._by_storage: dict[int, weakref.ref] = {}  # storage pointer -> weakref to the value's storage
        self._checked: set[str] = set()  # names whose value went through the reader's NaN/inf check

    def dequantized(self, name: str, w: torch.Tensor, scale: torch.Tensor, reader) -> torch.Tensor:
        """The float value of stored bytes w + scale for this call: checked for NaN/inf by the reader
        once per name (CheckpointReader's `_checked`: warned once, listed in `nonfinite`; the stored
        bytes do not change) and remembered."""
        value = dequantize(w, scale)
        if name not in self._checked:
            self._checked.add(name)
            nonfinite_checked(reader, name, value)
        self.remember(value)
        return value

    def remember(self, value: torch.Tensor) -> None:
        # the storage, not the tensor: a view made under inference_mode does not keep its base alive
        storage = value.untyped_storage()
        self._by_storage = {p: ref for p, ref in self._by_storage.items() if ref() is not None}
        self._by_storage[storage.data_ptr()] = weakref.ref(storage)

    def clear(self) -> None:
        self._by_storage.clear()

    def alive(self) -> int:
        """How many handed-out values are still referenced somewhere (none is kept here)."""
        return sum(1 for ref in self._by_storage.values() if ref() is not None)


class StoredWeights:
    """A weight source (get/rows/has/stored_dtype, engine/checkpoint/weights.py) whose tensors live on
    `device` in their stored dtypes. inner: a checkpoint's weights (CheckpointWeights: `.reader` and
    `.rows`) or None with `reader` given (a TensorReader). `loads` and `held_bytes` as CheckpointWeights'
    (tensors read, bytes held)."""

    def __init__(self, inner=None, device="cpu", reader=None, rows=None):
        if inner is None and reader is None:
            raise ValueError("StoredWeights needs a checkpoint's weights or a reader")
        self.inner = inner
        self.reader = reader if reader is not None else inner.reader
        self.device = torch.device(device)
        self._rows = rows  # rows(name, index) for tables never held whole (the Engram's); default: inner's
        self._stored: dict[str, torch.Tensor] = {}
        self._float: dict[str, torch.Tensor] = {}
        self._handed = HandedOut()
        self._stacks: dict[str, tuple] = {}  # routed-expert prefix -> stacks (stacked here from a checkpoint)
        self._loads = 0

    # -- the stored bytes --------------------------------------------------------------------------
    def stored(self, name: str) -> torch.Tensor | None:
        """The tensor on the device in its stored dtype (moved there once), or None if not stored."""
        hit = self._stored.get(name)
        if hit is None:
            if name not in self.reader:
                return None
            hit = self._stored[name] = self.reader.tensor(name).to(self.device)
            self._loads += 1
        return hit

    def stacked_experts(self, prefix: str, n_experts: int):
        """(w1, w1_scale, w3, w3_scale, w2, w2_scale) stacked over experts: the reader's stacks when it
        holds them so (no copy); else, for packed FP4 (I8) experts, stacked here once from the per-expert
        tensors, which become views of the stacks (the bytes held once, not per expert and again
        stacked by the kernel ops); None otherwise (not stored as packed FP4: the wrapped ops)."""
        fn = getattr(self.reader, "stacked_experts", None)
        stack = fn(prefix, n_experts) if fn is not None else None
        if stack is not None:
            return tuple(t.to(self.device) for t in stack)
        hit = self._stacks.get(prefix)
        if hit is not None and hit[0].shape[0] == n_experts:
            return hit
        names = [[f"{prefix}experts.{e}.{w}.{leaf}" for e in range(n_experts)] for w, leaf in _EXPERT_PARTS]
        if n_experts < 1 or not all(n in self.reader for part in names for n in part) \
                or self.stored_dtype(names[0][0]) != "I8":
            return None
        stacks = []
        for part in names:  # one part at a time on the host, then once to the device
            stacks.append(torch.stack([self.reader.tensor(n) for n in part]).to(self.device))
            self._loads += len(part)
            for e, n in enumerate(part):
                self._stored[n] = stacks[-1][e]
        hit = self._stacks[prefix] = tuple(stacks)
        return hit

    def stored_bytes(self) -> int:
        """Bytes held on the device: stored tensors plus the widened BF16/F32 weights."""
        seen, total = set(), 0
        for t in list(self._stored.values()) + list(self._float.values()):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    @property
    def held_bytes(self) -> int:
        return self.stored_bytes()

    @property
    def loads(self) -> int:
        """Tensors read from the reader so far (tests of laziness)."""
        return self._loads

    # -- the WeightSource surface ---------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.reader

    def stored_dtype(self, name: str) -> str:
        return self.reader.entry(name).dtype

    def get(self, name: str) -> torch.Tensor:
        """float32 value (see the module docstring: quantized weights are not kept as floats)."""
        hit = self._float.get(name)
        if hit is not None:
            return hit
        w = self.stored(name)
        if w is None:
            raise KeyError(f"weight '{name}' is missing")
        scale = self.stored(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if self.stored_dtype(name) in QUANTIZED and scale is not None:
            return self._handed.dequantized(name, w, scale, self.reader)
        value = self._float[name] = nonfinite_checked(self.reader, name, w.float())
        return value

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        if self._rows is not None:
            return self._rows(name, index)
        if self.inner is not None:
            return self.inner.rows(name, index.cpu()).to(self.device)
        table = self.get(name)
        return table[index.to(table.device)]
