"""The KV panel: the 890 B/token taken apart, the bounded window caches, and the cache at a context
length the user picks. All numbers come from `engine.tally`; after a run, the bytes the engine actually
held are drawn next to the formula (`measured`)."""

from __future__ import annotations

from dataclasses import dataclass


from engine.config import ModelConfig
from engine.tally import cache_breakdown_at, kv_breakdown, kv_bytes_per_token, window_bytes_per_layer

from .figure import Figure
from .style import GRID, INK, MUTED, ROLE_COLOURS, base_layout, fmt_bytes, fmt_tokens

CONTEXT_CHOICES = (1_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000, 256_000, 512_000, 1_000_000)
INDEX_COLOUR = "#E69F00"
WINDOW_COLOUR = "#A6A6A6"


@dataclass(frozen=True)
class KVRow:
    """One line of the per-token breakdown."""
    layer: int
    ratio: int
    entries_per_token: float
    main_entry_bytes: int
    index_key_bytes: int
    bytes_per_token: float


def kv_rows(cfg: ModelConfig) -> list[KVRow]:
    return [KVRow(k.layer, k.ratio, k.entries_per_token, k.main_entry_bytes, k.index_key_bytes, k.bytes_per_token)
            for k in kv_breakdown(cfg)]


def kv_table(cfg: ModelConfig) -> list[dict]:
    """Rows for a table: one per KV source, then the total line (its bytes = kv_bytes_per_token)."""
    rows = [{"layer": str(r.layer), "m": str(r.ratio), "entries/token": r.entries_per_token,
             "entry B": str(r.main_entry_bytes), "key B": str(r.index_key_bytes),
             "B/token": r.bytes_per_token} for r in kv_rows(cfg)]
    rows.append({"layer": "all", "m": "", "entries/token": sum(r.entries_per_token for r in kv_rows(cfg)),
                 "entry B": "", "key B": "", "B/token": kv_bytes_per_token(cfg)})
    return rows


def kv_explainer(cfg: ModelConfig) -> str:
    """The per-token sum in words, e.g. '2.5 entries × (288 + 68) B = 890 B per token'."""
    rows = kv_rows(cfg)
    if not rows:
        return "No layer holds global KV: only the sliding windows."
    entries = sum(r.entries_per_token for r in rows)
    same = len({(r.main_entry_bytes, r.index_key_bytes) for r in rows}) == 1
    total = kv_bytes_per_token(cfg)
    if same:
        r = rows[0]
        return (f"{len(rows)} layers hold global KV ({', '.join(str(r.layer) for r in rows)}): "
                f"{entries:g} entries per token × ({r.main_entry_bytes} B main entry + {r.index_key_bytes} B index key)"
                f" = **{total:g} B per token**.")
    return f"{len(rows)} layers hold global KV: **{total:g} B per token** in all."


def window_note(cfg: ModelConfig) -> str:
    w = window_bytes_per_layer(cfg)
    return (f"Sliding windows: every layer keeps {cfg.window_size} entries × "
            f"{cfg.head_dim + cfg.head_dim // 32} B (FP8 + E8M0) = {fmt_bytes(w)} per layer, "
            f"{fmt_bytes(w * cfg.n_layers)} for {cfg.n_layers} layers: bounded, never persisted.")


def context_series(cfg: ModelConfig, points: int = 60, max_len: int = 1_000_000) -> dict[str, list]:
    """Cache bytes at log-spaced context lengths from the window size to max_len."""
    lo = max(1, cfg.window_size // 2)
    lengths = sorted({int(round(lo * (max_len / lo) ** (i / (points - 1)))) for i in range(points)})
    rows = [cache_breakdown_at(cfg, n) for n in lengths]
    return {"context_len": lengths, **{k: [r[k] for r in rows] for k in ("global_kv", "index_keys", "windows", "total")}}


def kv_figure(cfg: ModelConfig, context_len: int, *, measured: dict | None = None, height: int = 320) -> Figure:
    """Cache bytes against context length, log-log: the global KV and index keys grow linearly, the
    windows stop growing at the window size. The picked length is marked; `measured` is the engine's
    own count after a run ({'context_len', 'total', ...}), drawn as a diamond beside the formula."""
    series = context_series(cfg)
    x = series["context_len"]
    fig = Figure()
    for key, name, colour, width in (("total", "total", INK, 2.4),
                                     ("global_kv", "global KV entries (FP4)", ROLE_COLOURS["full_m2"], 1.6),
                                     ("index_keys", "index keys (FP4)", INDEX_COLOUR, 1.6),
                                     ("windows", "sliding windows (FP8)", WINDOW_COLOUR, 1.6)):
        fig.add_trace(dict(type="scatter", x=x, y=[max(v, 1) for v in series[key]], mode="lines", name=name,
                           line=dict(width=width, color=colour),
                           hovertemplate=f"{name}: %{{y:,.0f}} B at %{{x:,}} tokens<extra></extra>"))
    at = cache_breakdown_at(cfg, context_len)
    fig.add_vline(x=context_len, line=dict(color=MUTED, width=1, dash="dot"))
    fig.add_trace(dict(type="scatter", x=[context_len], y=[at["total"]], mode="markers+text", name="picked",
                       marker=dict(size=9, color=INK), text=[f"{fmt_bytes(at['total'])} at {fmt_tokens(context_len)}"],
                       textposition="middle left" if context_len > 50_000 else "middle right",
                       hovertemplate="total %{y:,.0f} B at %{x:,} tokens<extra></extra>", showlegend=False))
    if measured:
        fig.add_trace(dict(type="scatter", x=[measured["context_len"]], y=[measured["total"]], mode="markers",
                           name="engine held (last run)", marker=dict(size=12, color="#D55E00", symbol="diamond"),
                           hovertemplate="engine held %{y:,.0f} B after %{x:,} tokens<extra></extra>"))
    fig.update_layout(**base_layout(
        height=height, showlegend=True, margin=dict(l=62, r=8, t=8, b=44),
        legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0, font=dict(size=11)),
        xaxis=dict(type="log", title=dict(text="context length (tokens)", font=dict(size=11, color=MUTED)),
                   gridcolor=GRID, tickfont=dict(size=10)),
        yaxis=dict(type="log", title=dict(text="bytes", font=dict(size=11, color=MUTED)), gridcolor=GRID,
                   tickfont=dict(size=10), tickformat=".2s"),
        hovermode="closest",
    ))
    return fig


def measured_vs_formula(cfg: ModelConfig, run: dict | None) -> dict | None:
    """After a run: the engine's measured cache bytes next to the formula at the prompt's length.
    `run` is `RunResult.to_json()`; returns None when there is no run."""
    if not run or "cache_bytes" not in run:
        return None
    n = len(run.get("token_ids") or run.get("tokens") or [])
    held = run["cache_bytes"]
    held = held if isinstance(held, dict) else {"total": int(held)}
    formula = cache_breakdown_at(cfg, n)
    return {"context_len": n, "total": held.get("total", 0), "global": held.get("global"),
            "window": held.get("window"), "pending": held.get("pending"),
            "formula_global": formula["global_kv"] + formula["index_keys"], "formula_window": formula["windows"],
            "formula_total": formula["total"], "kv_bytes_formula": run.get("kv_bytes_formula")}


def measured_lines(measured: dict) -> list[str]:
    """The run's cache check in words: what the formula counts (KV entries, index keys, windows) next
    to the engine's bytes of the same, and the pending compressor state on its own line (tokens not
    yet filling a compression group, held in fp32; the formula does not count them)."""
    pending = int(measured.get("pending") or 0)
    held = int(measured["total"]) - pending
    formula = int(measured["formula_total"])
    lines = [f"The run on screen ({measured['context_len']:,} tokens): KV entries, index keys and windows: the "
             f"engine held {held:,} B; the formula gives {formula:,} B"
             + (" (equal)." if held == formula else f" (a difference of {held - formula:+,} B).")]
    if pending:
        lines.append(f"Pending compressor state: {pending:,} B more (the last tokens of each compressed layer that do "
                     "not fill a group yet, kept in fp32 until they do; not part of the formula).")
    return lines

