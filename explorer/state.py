"""What defines the view, how a URL maps to it and back, and the selection callbacks' pure logic.

The URL carries only what reproduces a view: `?layer=24&tab=reindex&pos=decode` (later `&session=ID`).
Everything here is plain Python so it can be tested without Streamlit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from engine.roles import TABS, LayerRole

POSITIONS = ("total", "decode", "prefill")
POSITION_TITLES = {"total": "Total", "decode": "Active per generated token",
                   "prefill": "Active per prompt token"}
DEFAULT_LAYER = 24   # the first Reindex layer of the release: the most interesting default
URL_KEYS = ("layer", "tab", "pos", "session")


@dataclass(frozen=True)
class ViewState:
    layer: int = DEFAULT_LAYER
    tab: str = "reindex"
    position: str = "total"
    session: str | None = None

    def to_query(self) -> dict[str, str]:
        """The query parameters that reproduce this view (defaults left out of `pos`)."""
        out = {"layer": str(self.layer), "tab": self.tab}
        if self.position != "total":
            out["pos"] = self.position
        if self.session:
            out["session"] = self.session
        return out


def default_state(plan: list[LayerRole]) -> ViewState:
    layer = DEFAULT_LAYER if DEFAULT_LAYER < len(plan) else 0
    return ViewState(layer=layer, tab=plan[layer].tab)


def state_from_query(query: Mapping[str, Any], plan: list[LayerRole]) -> tuple[ViewState, list[str]]:
    """Parse query parameters into a view; bad values fall back to defaults, each with a message."""
    state, problems = default_state(plan), []

    def first(key: str) -> str | None:
        value = query.get(key)
        if isinstance(value, (list, tuple)):
            value = value[-1] if value else None
        return None if value is None else str(value)

    raw_layer = first("layer")
    if raw_layer is not None:
        layer = parse_layer(raw_layer, plan)
        if layer is None:
            problems.append(f"URL layer '{raw_layer}' is not a layer of this model (0..{len(plan) - 1}); "
                            f"showing layer {state.layer}.")
        else:
            state = replace(state, layer=layer, tab=plan[layer].tab)
    raw_tab = first("tab")
    if raw_tab is not None:
        if raw_tab in TABS:
            state = replace(state, tab=raw_tab)
        else:
            problems.append(f"URL tab '{raw_tab}' is not one of {', '.join(TABS)}.")
    raw_pos = first("pos")
    if raw_pos is not None:
        if raw_pos in POSITIONS:
            state = replace(state, position=raw_pos)
        else:
            problems.append(f"URL pos '{raw_pos}' is not one of {', '.join(POSITIONS)}.")
    session = first("session")
    if session:
        state = replace(state, session=session)
    return state, problems


def parse_layer(raw: Any, plan: list[LayerRole]) -> int | None:
    try:
        layer = int(str(raw).strip())
    except ValueError:
        return None
    return layer if 0 <= layer < len(plan) else None


def picked_points(selection: Any) -> list:
    """`event.selection.points` from Streamlit's PlotlyState, a dict, or already a list of points (a
    click on the explorer's own chart component)."""
    if selection is None:
        return []
    if isinstance(selection, list):
        return selection
    sel = selection.get("selection") if isinstance(selection, Mapping) else getattr(selection, "selection", None)
    if sel is None:
        sel = selection
    points = sel.get("points") if isinstance(sel, Mapping) else getattr(sel, "points", None)
    return list(points or [])


def picked_customdata(selection: Any) -> list[list]:
    """The customdata of every picked point that carries one, in click order."""
    out = []
    for point in picked_points(selection):
        data = point.get("customdata") if isinstance(point, Mapping) else getattr(point, "customdata", None)
        if data is None:
            continue
        out.append(list(data) if isinstance(data, (list, tuple)) else [data])
    return out


def layer_from_selection(selection: Any, plan: list[LayerRole]) -> int | None:
    """The layer a plan click picked: customdata = [layer, role]; the last valid point wins."""
    for data in reversed(picked_customdata(selection)):
        layer = parse_layer(data[0], plan) if data else None
        if layer is not None:
            return layer
    return None


def select_layer(state: ViewState, selection: Any, plan: list[LayerRole]) -> ViewState:
    """A plan click: select the layer and flip the diagram to its role tab. Empty clicks keep the view."""
    layer = layer_from_selection(selection, plan)
    if layer is None:
        return state
    return replace(state, layer=layer, tab=plan[layer].tab)


def boxes_from_selection(selection: Any) -> list[str]:
    """Box ids picked in the diagram or the tally bars (customdata[0] is a box id or a row's box list)."""
    boxes: list[str] = []
    for data in picked_customdata(selection):
        if not data:
            continue
        head = data[0]
        items: Iterable = head.split("|") if isinstance(head, str) else []
        boxes.extend(b for b in items if b and b not in boxes)
    return boxes
