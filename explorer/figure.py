"""Plotly figures as plain data.

`plotly.graph_objects` checks every property against the schema as it is set: 10-40 ms per figure
here, and a layer click builds about seven, on a 2-core box where the browser draws at the same
time. The builders write the same figures as dicts through this small class instead; the tests check
every builder's output against plotly's schema (`Figure.validated`). Reads look like plotly's
(`fig.data[0].z`, `fig.layout.xaxis.range`; unset properties read as None).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

# numpy dtypes plotly.js reads as typed arrays ({"dtype", "bdata", "shape"}): one binary block per array
_TYPED = {np.dtype(t): code for t, code in (("int8", "i1"), ("uint8", "u1"), ("int16", "i2"), ("uint16", "u2"),
                                             ("int32", "i4"), ("uint32", "u4"), ("float32", "f4"),
                                             ("float64", "f8"))}


class Props(dict):
    """A dict whose keys also read as attributes; nested dicts read as Props, missing keys as None."""

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return _view(self.get(key))


def _view(value: Any) -> Any:
    if type(value) is dict:
        return Props(value)
    if isinstance(value, list) and value and all(type(v) is dict for v in value):
        return [Props(v) for v in value]
    return value


def merge(base: dict, update: dict) -> dict:
    """`update` merged into `base` in place, nested dicts key by key (like plotly's update_layout)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


class Figure:
    """`data`: a list of trace dicts (each with its `type`); `layout`: a dict."""

    def __init__(self, data: list[dict] | None = None, layout: dict | None = None):
        self.data: list[Props] = [Props(t) for t in data or []]
        self.layout: Props = Props(layout or {})

    def add_trace(self, trace: dict) -> Figure:
        if "type" not in trace:
            raise ValueError("a trace needs its plotly type, e.g. type='scatter'")
        self.data.append(Props(trace))
        return self

    def update_layout(self, **layout) -> Figure:
        merge(self.layout, layout)
        return self

    def add_shape(self, **shape) -> Figure:
        self.layout.setdefault("shapes", []).append(shape)
        return self

    def add_annotation(self, **annotation) -> Figure:
        self.layout.setdefault("annotations", []).append(annotation)
        return self

    def add_hline(self, y: float, line: dict | None = None) -> Figure:
        """A horizontal line across the whole plot width at data height y."""
        return self.add_shape(type="line", xref="x domain", yref="y", x0=0, x1=1, y0=y, y1=y, line=line or {})

    def add_vline(self, x: float, line: dict | None = None) -> Figure:
        """A vertical line across the whole plot height at data position x."""
        return self.add_shape(type="line", xref="x", yref="y domain", x0=x, x1=x, y0=0, y1=1, line=line or {})

    def to_plotly_json(self) -> dict:
        """The figure as plotly.js reads it; numeric numpy arrays become typed-array blocks."""
        return {"data": [_encode(t) for t in self.data], "layout": _encode(self.layout)}

    def to_json(self) -> str:
        from plotly.io.json import to_json_plotly
        return to_json_plotly(self.to_plotly_json())

    def validated(self):
        """The same figure as a plotly.graph_objects.Figure: raises ValueError on any property the
        schema does not know (the tests call this for every builder)."""
        import plotly.graph_objects as go
        return go.Figure(self.to_plotly_json())


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        code = _TYPED.get(value.dtype)
        if code is None:
            if value.dtype.kind in "iu" and value.size and value.min() >= -2**31 and value.max() < 2**31:
                return _encode(value.astype(np.int32))
            if value.dtype.kind == "f":
                return _encode(value.astype(np.float64))
            return value.tolist()
        block = np.ascontiguousarray(value)
        out = {"dtype": code, "bdata": base64.b64encode(block.tobytes()).decode()}
        if block.ndim > 1:
            out["shape"] = ", ".join(str(n) for n in block.shape)
        return out
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
