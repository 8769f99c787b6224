"""The numerics seam: every place where the forward's arithmetic depends on a number format
calls an `Ops` object chosen once, when the model is built.

- `reference` (the default for runs): the official V4.1 reference's dtype flow. Activations are
  bf16 between ops (norms, GEMM outputs, RoPE, the mHC collapse and update, the sparse attention's
  output); reductions, mHC mixes, routing and softmaxes run in fp32; the sparse attention rounds its
  probabilities to bf16 against the running max of blocks of 64 entries, as the reference's kernels.
- `fp32`: every activation stays float32 between ops (the engine's original arithmetic, and what
  training uses).

Both keep tensors as float32; `reference` rounds their values to bf16 where the reference stores
bf16 (`Ops.act`), so probes and caches keep one dtype whatever the numerics.
"""

from __future__ import annotations

from .fp32 import Fp32Ops
from .reference import ReferenceOps

NUMERICS = ("reference", "fp32")
DEFAULT_NUMERICS = "reference"
_OPS = {"reference": ReferenceOps, "fp32": Fp32Ops}


class NumericsError(ValueError):
    """An unknown numerics name."""


def ops_for(numerics: str | None = None) -> Fp32Ops:
    """The ops of a numerics name (None: the default, `reference`)."""
    name = DEFAULT_NUMERICS if numerics is None else numerics
    if name not in _OPS:
        raise NumericsError(f"unknown numerics {name!r}; choose one of {', '.join(NUMERICS)}")
    return _OPS[name]()
