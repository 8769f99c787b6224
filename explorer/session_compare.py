"""Compare probe results (the engine's ``RunResult.to_json()`` dicts): two prompts side by side at
one layer, and a saved run against its replay.

Probe layout used here (per layer key, a string such as ``"24"``):
``topk: [T][k]`` selected KV entries per query position (negative = padding, ignored),
``candidate_pool: [T][m] | None``, ``mhc: {"attn"|"ffn": {"pre": [T][4], "post": [T][4],
"comb": [T][4][4]}}``, ``routing: {"experts": [T][6], "weights": [T][6]}``.
Selections and experts are compared as sets: their order (ties in top-k) carries no meaning.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CompareError",
    "LayerComparison",
    "PositionDiff",
    "ReplayReport",
    "ReplaySection",
    "compare_layer",
    "replay_report",
]


class CompareError(ValueError):
    """The two results cannot be compared as asked (e.g. the layer is missing); a user message."""


# ----------------------------------------------------------------------------------------------
# helpers


def _layer_key(layer: int | str) -> str:
    return str(int(layer)) if isinstance(layer, int) or str(layer).lstrip("-").isdigit() else str(layer)


def _layer_sort_key(key: str) -> tuple[int, Any]:
    return (0, int(key)) if key.lstrip("-").isdigit() else (1, key)


def _rows(value: Any) -> list[Any]:
    """A per-position list, or [] when the probe was not recorded."""
    return list(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else []


def _index_set(row: Any) -> frozenset[int]:
    return frozenset(int(i) for i in (row or []) if int(i) >= 0)


def _token(probes: Mapping[str, Any], q: int) -> str | None:
    tokens = probes.get("tokens") or []
    return str(tokens[q]) if q < len(tokens) else None


def _fmt_set(values: frozenset[int] | set[int] | tuple[int, ...]) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}" if values else "{}"


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(a)


def _walk(a: Any, b: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any, Any]]:
    """Pairs of leaves of two nested lists; a shape mismatch yields (path, a, b) with the lists."""
    a_list = isinstance(a, Sequence) and not isinstance(a, str)
    b_list = isinstance(b, Sequence) and not isinstance(b, str)
    if a_list and b_list and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _walk(x, y, path + (i,))
    else:
        yield path, a, b


# ----------------------------------------------------------------------------------------------
# side by side: two prompts, one layer


@dataclass(frozen=True)
class PositionDiff:
    """One query position of the two runs. Sets are of KV-entry indices / expert ids."""

    position: int
    token_a: str | None
    token_b: str | None
    selected_only_a: frozenset[int]
    selected_only_b: frozenset[int]
    selected_common: frozenset[int]
    experts_only_a: frozenset[int]
    experts_only_b: frozenset[int]
    experts_common: frozenset[int]

    @property
    def selections_differ(self) -> bool:
        return bool(self.selected_only_a or self.selected_only_b)

    @property
    def routing_differs(self) -> bool:
        return bool(self.experts_only_a or self.experts_only_b)


@dataclass(frozen=True)
class LayerComparison:
    """Per-position differences at one layer, plus what could not be compared."""

    layer: str
    n_positions_a: int
    n_positions_b: int
    has_selections: bool
    has_routing: bool
    positions: tuple[PositionDiff, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def selection_diff_positions(self) -> list[int]:
        return [p.position for p in self.positions if p.selections_differ]

    @property
    def routing_diff_positions(self) -> list[int]:
        return [p.position for p in self.positions if p.routing_differs]

    def mean_selection_overlap(self) -> float | None:
        """Mean Jaccard overlap of the selected sets over positions both runs have."""
        return _mean_jaccard(
            (p.selected_common, p.selected_only_a, p.selected_only_b) for p in self._shared_positions()
        ) if self.has_selections else None

    def mean_expert_overlap(self) -> float | None:
        return _mean_jaccard(
            (p.experts_common, p.experts_only_a, p.experts_only_b) for p in self._shared_positions()
        ) if self.has_routing else None

    def _shared_positions(self) -> list[PositionDiff]:
        return [p for p in self.positions if p.token_a is not None and p.token_b is not None]


def _mean_jaccard(triples: Iterator[tuple[frozenset[int], frozenset[int], frozenset[int]]]) -> float | None:
    scores = []
    for common, only_a, only_b in triples:
        union = len(common) + len(only_a) + len(only_b)
        scores.append(1.0 if union == 0 else len(common) / union)
    return sum(scores) / len(scores) if scores else None


def compare_layer(a: Mapping[str, Any], b: Mapping[str, Any], layer: int | str) -> LayerComparison:
    """Which selected entries and which routed experts differ, per query position, at ``layer``.

    Positions run to the longer prompt; past the shorter one, everything of the longer one counts
    as "only" there (token None on the short side). Raises ``CompareError`` if a run lacks the layer.
    """
    key = _layer_key(layer)
    layers_a = a.get("layers") or {}
    layers_b = b.get("layers") or {}
    missing = [side for side, layers in (("A", layers_a), ("B", layers_b)) if key not in layers]
    if missing:
        raise CompareError(f"Layer {key} was not probed in run {' and '.join(missing)}; run both prompts at that layer.")
    la, lb = layers_a[key], layers_b[key]

    notes = []
    if la.get("role") != lb.get("role"):
        notes.append(f"Layer roles differ: {la.get('role')!r} vs {lb.get('role')!r}.")
    topk_a, topk_b = _rows(la.get("topk")), _rows(lb.get("topk"))
    has_sel = bool(topk_a) and bool(topk_b)
    if not has_sel and (topk_a or topk_b):
        notes.append("Selections were recorded in only one run.")
    experts_a = _rows((la.get("routing") or {}).get("experts"))
    experts_b = _rows((lb.get("routing") or {}).get("experts"))
    has_rout = bool(experts_a) and bool(experts_b)
    if not has_rout and (experts_a or experts_b):
        notes.append("Routing was recorded in only one run.")

    n_a = len(a.get("tokens") or []) or max(len(topk_a), len(experts_a))
    n_b = len(b.get("tokens") or []) or max(len(topk_b), len(experts_b))
    positions = []
    for q in range(max(n_a, n_b)):
        sa = _index_set(topk_a[q]) if has_sel and q < len(topk_a) else frozenset()
        sb = _index_set(topk_b[q]) if has_sel and q < len(topk_b) else frozenset()
        ea = _index_set(experts_a[q]) if has_rout and q < len(experts_a) else frozenset()
        eb = _index_set(experts_b[q]) if has_rout and q < len(experts_b) else frozenset()
        positions.append(
            PositionDiff(
                position=q,
                token_a=_token(a, q) if q < n_a else None,
                token_b=_token(b, q) if q < n_b else None,
                selected_only_a=sa - sb,
                selected_only_b=sb - sa,
                selected_common=sa & sb,
                experts_only_a=ea - eb,
                experts_only_b=eb - ea,
                experts_common=ea & eb,
            )
        )
    return LayerComparison(
        layer=key, n_positions_a=n_a, n_positions_b=n_b, has_selections=has_sel, has_routing=has_rout,
        positions=tuple(positions), notes=tuple(notes),
    )


# ----------------------------------------------------------------------------------------------
# replay: the saved run against a fresh one


@dataclass(frozen=True)
class ReplaySection:
    """One aspect of the replay: identical, or the first differences (readable lines)."""

    name: str
    identical: bool
    compared: int  # how many items (positions, or values for mHC) were compared
    n_differences: int
    differences: tuple[str, ...]


@dataclass(frozen=True)
class ReplayReport:
    identical: bool
    sections: dict[str, ReplaySection]

    def summary(self) -> str:
        """A few lines for the UI (plain text; escape before rendering as markdown/HTML)."""
        if self.identical:
            parts = ", ".join(f"{s.name} ({s.compared} compared)" for s in self.sections.values())
            return f"Replay identical: {parts}."
        lines = ["Replay differs:"]
        for s in self.sections.values():
            if s.identical:
                lines.append(f"- {s.name}: identical ({s.compared} compared)")
            else:
                lines.append(f"- {s.name}: {s.n_differences} difference(s) in {s.compared} compared")
                lines.extend(f"    {d}" for d in s.differences)
        return "\n".join(lines)


class _Collector:
    def __init__(self, name: str, limit: int):
        self.name, self.limit = name, limit
        self.compared = 0
        self.count = 0
        self.lines: list[str] = []

    def diff(self, line: str) -> None:
        self.count += 1
        if len(self.lines) < self.limit:
            self.lines.append(line)

    def section(self) -> ReplaySection:
        return ReplaySection(self.name, self.count == 0, self.compared, self.count, tuple(self.lines))


def _where(layer: str, q: int, saved: Mapping[str, Any]) -> str:
    tok = _token(saved, q)
    return f"layer {layer}, position {q}" + (f" ({tok!r})" if tok is not None else "")


def _compare_sets(out: _Collector, what: str, layer: str, saved_rows: list, new_rows: list, saved: Mapping) -> None:
    if len(saved_rows) != len(new_rows):
        out.diff(f"layer {layer}: {what} for {len(saved_rows)} positions saved, {len(new_rows)} replayed")
    for q in range(min(len(saved_rows), len(new_rows))):
        out.compared += 1
        s, n = _index_set(saved_rows[q]), _index_set(new_rows[q])
        if s != n:
            out.diff(f"{_where(layer, q, saved)}: {what} only saved {_fmt_set(s - n)}, only replayed {_fmt_set(n - s)}")


def replay_report(
    saved: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    max_listed: int = 5,
) -> ReplayReport:
    """Did a re-run reproduce the saved probes? Selections and routed experts must match exactly
    (as sets); mHC coefficients and routing weights within ``atol + rtol*|saved|``.

    Sections: tokens, layers (which were probed, their roles and sources), selections, mhc,
    routing. Each lists at most ``max_listed`` differences, in layer then position order.
    """
    tokens = _Collector("tokens", max_listed)
    for key in ("token_ids", "tokens"):
        s_rows, n_rows = _rows(saved.get(key)), _rows(new.get(key))
        tokens.compared = max(tokens.compared, len(s_rows), len(n_rows))   # positions, not ids + texts
        if len(s_rows) != len(n_rows):
            tokens.diff(f"{key}: {len(s_rows)} saved, {len(n_rows)} replayed")
        for q, (s, n) in enumerate(zip(s_rows, n_rows)):
            if s != n:
                tokens.diff(f"{key}[{q}]: saved {s!r}, replayed {n!r}")

    layers = _Collector("layers", max_listed)
    s_layers = saved.get("layers") or {}
    n_layers = new.get("layers") or {}
    for key in sorted(set(s_layers) | set(n_layers), key=_layer_sort_key):
        layers.compared += 1
        if key not in n_layers:
            layers.diff(f"layer {key}: saved but not replayed")
        elif key not in s_layers:
            layers.diff(f"layer {key}: replayed but not in the saved run")
        else:
            for attr in ("role", "kv_source", "index_source"):
                if s_layers[key].get(attr) != n_layers[key].get(attr):
                    layers.diff(f"layer {key}: {attr} saved {s_layers[key].get(attr)!r}, "
                                f"replayed {n_layers[key].get(attr)!r}")
    common = sorted(set(s_layers) & set(n_layers), key=_layer_sort_key)

    selections = _Collector("selections", max_listed)
    mhc = _Collector("mhc", max_listed)
    routing = _Collector("routing", max_listed)
    for key in common:
        ls, ln = s_layers[key], n_layers[key]
        for what in ("topk", "candidate_pool"):
            s_rows, n_rows = _rows(ls.get(what)), _rows(ln.get(what))
            if (ls.get(what) is None) != (ln.get(what) is None):
                selections.diff(f"layer {key}: {what} recorded in only one run")
            elif s_rows or n_rows:
                _compare_sets(selections, "selected" if what == "topk" else "candidates", key, s_rows, n_rows, saved)

        _compare_mhc(mhc, key, ls.get("mhc"), ln.get("mhc"), saved, atol, rtol)

        rs, rn = ls.get("routing") or {}, ln.get("routing") or {}
        s_exp, n_exp = _rows(rs.get("experts")), _rows(rn.get("experts"))
        if bool(s_exp) != bool(n_exp):
            routing.diff(f"layer {key}: routing recorded in only one run")
            continue
        _compare_sets(routing, "experts", key, s_exp, n_exp, saved)
        s_w, n_w = _rows(rs.get("weights")), _rows(rn.get("weights"))
        for q in range(min(len(s_exp), len(n_exp), len(s_w), len(n_w))):
            if _index_set(s_exp[q]) != _index_set(n_exp[q]):
                continue  # already reported as an expert difference
            saved_w = dict(zip((int(e) for e in s_exp[q]), s_w[q]))
            new_w = dict(zip((int(e) for e in n_exp[q]), n_w[q]))
            for expert in sorted(saved_w):
                if expert in new_w and not _close(float(saved_w[expert]), float(new_w[expert]), atol, rtol):
                    routing.diff(f"{_where(key, q, saved)}: weight of expert {expert} saved "
                                 f"{float(saved_w[expert]):.6g}, replayed {float(new_w[expert]):.6g}")

    sections = {c.name: c.section() for c in (tokens, layers, selections, mhc, routing)}
    return ReplayReport(all(s.identical for s in sections.values()), sections)


def _compare_mhc(out: _Collector, layer: str, saved_mhc: Any, new_mhc: Any, saved: Mapping[str, Any],
                 atol: float, rtol: float) -> None:
    if saved_mhc is None and new_mhc is None:
        return
    if (saved_mhc is None) != (new_mhc is None):
        out.diff(f"layer {layer}: mHC recorded in only one run")
        return
    for part in sorted(set(saved_mhc) | set(new_mhc)):
        sp, np_ = saved_mhc.get(part), new_mhc.get(part)
        if not isinstance(sp, Mapping) or not isinstance(np_, Mapping):
            out.diff(f"layer {layer}: mHC {part} recorded in only one run")
            continue
        for coeff in ("pre", "post", "comb"):
            s_rows, n_rows = _rows(sp.get(coeff)), _rows(np_.get(coeff))
            if len(s_rows) != len(n_rows):
                out.diff(f"layer {layer}: mHC {part}.{coeff} for {len(s_rows)} positions saved, {len(n_rows)} replayed")
            for q in range(min(len(s_rows), len(n_rows))):
                for path, s, n in _walk(s_rows[q], n_rows[q]):
                    out.compared += 1
                    index = "".join(f"[{i}]" for i in path)
                    if not isinstance(s, (int, float)) or not isinstance(n, (int, float)):
                        if s != n:
                            out.diff(f"{_where(layer, q, saved)}: mHC {part}.{coeff}{index} shapes differ")
                        continue
                    if not _close(float(s), float(n), atol, rtol):
                        out.diff(f"{_where(layer, q, saved)}: mHC {part}.{coeff}{index} saved {float(s):.6g}, "
                                 f"replayed {float(n):.6g} (|diff| {abs(float(s) - float(n)):.2g})")
