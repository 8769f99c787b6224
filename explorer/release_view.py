"""Release first: the header, tally and KV panels lead with DeepSeek-V4.1-Flash's own figures (from the
release config) and show the live model's beside them, labelled as what it is. A checkpoint folder
replaces the live model's column, never the release's."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.tally import Tally, cache_breakdown_at

from . import kv_view
from .style import fmt_bytes, fmt_params

# the widths that are scaled down in a small model of the same plan (name, label)
_WIDTHS = (("dim", "width"), ("n_routed_experts", "routed experts"), ("n_heads", "heads"),
           ("index_topk", "top-k"), ("window_size", "window"))


def same_plan(release: ModelConfig, live: ModelConfig) -> bool:
    """Same layer roles: layer count, compress ratios, KV and index sources, Engram layers."""
    n = release.n_layers   # the DSpark stages' entries are not part of the plan
    return (n == live.n_layers and tuple(release.compress_ratios[:n]) == tuple(live.compress_ratios[:n])
            and tuple(release.kv_source_layers) == tuple(live.kv_source_layers)
            and tuple(release.index_source_layers) == tuple(live.index_source_layers)
            and tuple(release.engram_layer_ids) == tuple(live.engram_layer_ids))


def scaled_widths(release: ModelConfig, live: ModelConfig) -> list[str]:
    """`width 256 (release 5,120)` for every listed width that differs."""
    return [f"{label} {getattr(live, name):,} (release {getattr(release, name):,})"
            for name, label in _WIDTHS if getattr(live, name) != getattr(release, name)]


@dataclass
class Headline:
    release: str          # the release's figures, always
    live: str | None      # the live model's, labelled; None in "config only"


def live_label(source_kind: str) -> str:
    return "checkpoint folder" if source_kind == "path" else "live model"


def headline(release: ModelConfig, release_tally: Tally, live: ModelConfig | None, live_tally: Tally | None,
             source_kind: str = "shipped") -> Headline:
    """The two header lines: the release's tally, then what is actually running."""
    text = (f"{release.n_layers} layers + {release.n_mtp_layers} DSpark stages · "
            f"{fmt_params(release_tally.total_params)} parameters · {fmt_params(release_tally.active_decode_params)} "
            f"active per generated token · {kv_view.kv_bytes_per_token(release):g} B of global KV per token "
            "(release config)")
    if live is None or live_tally is None:
        return Headline(text, None)
    plan = f"same {live.n_layers}-layer plan" if same_plan(release, live) else f"its own {live.n_layers}-layer plan"
    widths = "release widths" if not scaled_widths(release, live) else "widths scaled"
    where = "checkpoint headers" if live_tally.source != "config" else "config"
    return Headline(text, f"{live_label(source_kind)}: {fmt_params(live_tally.total_params)} parameters, {plan}, "
                          f"{widths} · {fmt_params(live_tally.active_decode_params)} active per token · "
                          f"{kv_view.kv_bytes_per_token(live):g} B of KV per token · from {where}")


def live_note(release: ModelConfig, live: ModelConfig) -> str:
    """What differs between the live model and the release, in one line (for a caption)."""
    widths = scaled_widths(release, live)
    plan = "the same layer plan" if same_plan(release, live) else "a different layer plan"
    return f"The live model has {plan}" + (f"; scaled: {', '.join(widths)}." if widths else " and the release widths.")


def kv_compare(release: ModelConfig, live: ModelConfig | None, context: int) -> list[dict]:
    """Rows for the KV panel at one context length: the release, then the live model beside it."""
    rows = []
    for label, cfg in (("release", release), ("live model", live)):
        if cfg is None:
            continue
        n = min(context, cfg.max_seq_len) if label != "release" else context
        at = cache_breakdown_at(cfg, n)
        rows.append({"model": label, "KV per token": f"{kv_view.kv_bytes_per_token(cfg):g} B",
                     "context": f"{n:,}" + (" (its max)" if n < context else ""),
                     "global KV + index keys": fmt_bytes(at["global_kv"] + at["index_keys"]),
                     "windows": fmt_bytes(at["windows"]), "total": fmt_bytes(at["total"])})
    return rows
