"""Warnings about a run's numbers: NaN or infinite values in the selected layer's probes, and the
checkpoint weights the engine found holding them (engine.checkpoint.CheckpointReader.nonfinite)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

# what a click checks: small per-token arrays ([T, hc]); a NaN anywhere upstream reaches the residual
# stream, so its norms show it without reading the [T, experts] routing scores on every click
CHECKED = (("residual_norms", ("residual_norms",)), ("mHC attention weights", ("mhc", "attn", "pre")),
           ("mHC FFN weights", ("mhc", "ffn", "pre")))
NAMED_WEIGHTS = 3


def _at(probe: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = probe
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def nonfinite_counts(probe: Mapping[str, Any] | None) -> dict[str, tuple[int, int]]:
    """{what: (non-finite values, values)} for each checked array of a layer's probes that holds any."""
    out = {}
    for what, path in CHECKED:
        value = _at(probe or {}, path)
        if value is None:
            continue
        try:
            values = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):   # ragged or not numbers: the views report malformed probes
            continue
        bad = int(values.size - np.isfinite(values).sum())
        if bad:
            out[what] = (bad, int(values.size))
    return out


def nonfinite_warning(probe: Mapping[str, Any] | None, layer: int, bad_weights: Iterable[str] = ()) -> str | None:
    """One message for the live views when the run's numbers are not finite (None when they are)."""
    counts = nonfinite_counts(probe)
    weights = list(bad_weights)
    if not counts and not weights:
        return None
    parts = []
    if counts:
        found = "; ".join(f"{what}: {bad:,} of {n:,}" for what, (bad, n) in counts.items())
        parts.append(f"This run produced NaN or infinite values at layer {layer} ({found}); the views below leave "
                     "them out or draw them as gaps, so what they show is not the model's behaviour.")
    if weights:
        named = ", ".join(f"'{w}'" for w in weights[:NAMED_WEIGHTS])
        more = f" and {len(weights) - NAMED_WEIGHTS} more" if len(weights) > NAMED_WEIGHTS else ""
        parts.append(f"The checkpoint's weights hold NaN or infinite values ({named}{more}): every result computed "
                     "after them is NaN. Check or re-download the checkpoint.")
    return " ".join(parts)
