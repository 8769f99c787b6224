"""Where the Triton kernel ops can run, and whether a model takes them (`decide`; engine/ops/triton.py's
docstring has the rules). No torch work here beyond a device's type: the checks read the weight source's
attributes and the process's triton state."""

from __future__ import annotations

import os
import sys

import torch


class KernelPathError(ValueError):
    """The kernel ops cannot run here; the message says why."""


def interpreter_active() -> bool:
    """True when the kernels were (or will be) built for TRITON_INTERPRET=1."""
    mod = sys.modules.get("kernels.sparse_attn")
    if mod is not None:
        return type(mod._sparse_attn_kernel).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def enable_interpreter() -> bool:
    """Make the Triton kernels run on the CPU (TRITON_INTERPRET=1). Possible only before the kernels
    are imported in this process; returns whether the interpreter is (now) on."""
    if "kernels.sparse_attn" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreter_active()


def triton_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def checkpoint_backed(weights) -> bool:
    """Weights whose raw stored bytes can be read (CheckpointWeights, DeviceWeights over one)."""
    return getattr(weights, "reader", None) is not None


def shards_stored_bytes(weights) -> bool:
    """A rank's weight source that hands out its slices in the stored formats (engine/serve/parallel.py
    ShardedWeights), so the kernels of one rank read only its shard."""
    return callable(getattr(weights, "stored", None)) and getattr(weights, "parallel", None) is not None


def decide(flag: bool | None, weights, device, parallel=None) -> bool:
    """Whether a model on `device` runs the kernel ops (see the module docstring)."""
    device = torch.device(device)
    if flag is False:
        return False
    rank_ready = parallel is None or shards_stored_bytes(weights)
    if flag is None:
        return device.type == "cuda" and rank_ready and checkpoint_backed(weights) and triton_importable()
    if not rank_ready:
        raise KernelPathError("one rank of several runs the kernel path on its shard of the stored bytes: "
                              "its weights must be a ShardedWeights (engine.run.api.load(parallel=...))")
    if not checkpoint_backed(weights):
        raise KernelPathError("the kernel path reads a checkpoint's stored bytes; these weights are in-memory "
                              "tensors (kernels=True needs weights from engine.run.api.load)")
    return True
