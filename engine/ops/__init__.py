"""The numerics seam: every place where the forward's arithmetic depends on a number format
calls an `Ops` object chosen once, when the model is built.

- `reference` (the default for runs): the official V4.1 reference's dtype flow. Activations are
  bf16 between ops (norms, GEMM outputs, RoPE, the mHC collapse and update, the sparse attention's
  output); reductions, mHC mixes, routing and softmaxes run in fp32; the sparse attention rounds its
  probabilities to bf16 against the running max of blocks of 64 entries, as the reference's kernels.
- `fp32`: every activation stays float32 between ops (the engine's original arithmetic, and what
  training uses).

- `triton` (engine/ops/triton.py): either numerics with its hot spots on the Triton kernels (the
  GPU path); chosen by `for_model` from the device and the weights, never inside the forward.

Both keep tensors as float32; `reference` rounds their values to bf16 where the reference stores
bf16 (`Ops.act`), so probes and caches keep one dtype whatever the numerics.
"""

from __future__ import annotations

NUMERICS = ("reference", "fp32")
DEFAULT_NUMERICS = "reference"
# (the numerics' modules import torch: they load with the first model, not with `engine.ops`, so that
# the CLI's tally and plan commands start without torch)


class NumericsError(ValueError):
    """An unknown numerics name."""


def ops_for(numerics: str | None = None) -> "Fp32Ops":
    """The ops of a numerics name (None: the default, `reference`)."""
    name = DEFAULT_NUMERICS if numerics is None else numerics
    if name not in NUMERICS:
        raise NumericsError(f"unknown numerics {name!r}; choose one of {', '.join(NUMERICS)}")
    from .fp32 import Fp32Ops
    from .reference import ReferenceOps
    return {"reference": ReferenceOps, "fp32": Fp32Ops}[name]()


def for_model(numerics: str | None, kernels: bool | None, weights, device="cpu", parallel=None,
              act_quant: bool = True, max_seq_len: int | None = None):
    """The ops a model runs, chosen once when it is built: the numerics, wrapped in the Triton kernel
    ops where `kernels` (None: auto) and the device allow (engine/ops/triton.py `decide`). The CPU
    default is decided without importing the kernels."""
    import torch

    ops = ops_for(numerics)
    if max_seq_len is not None:
        ops.max_seq_len = max_seq_len  # tables sized as the reference sizes them
    if kernels is False or (kernels is None and torch.device(device).type != "cuda"):
        return ops
    from .triton import TritonOps, decide
    if not decide(kernels, weights, device, parallel):
        return ops
    return TritonOps(ops, weights, device, act_quant=act_quant)
