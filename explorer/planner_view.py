"""The "Serving plan" view: its inputs as URL and session values, the stacked bar of bytes per GPU, the
per-role roofline table, the largest batch against context length, and measured figures beside the
prediction (a live run's cache bytes; benches/results' release-size layer times and resident weights).
Pure: engine.plan does the arithmetic, this module only shapes it (no Streamlit)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.plan import (GPUS, Phase, Plan, PlanError, PlanInputs, check_inputs, largest_batch,
                         layer_boxes, layer_work, cache_per_sequence, model_max_context, weights_per_gpu)
from engine.roles import role_plan
from engine.tally import Tally, tally_from_config

from .figure import Figure
from .style import GRID, INK, MUTED, ROLE_COLOURS, base_layout, fmt_bytes, fmt_tokens

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benches" / "results"
# URL keys -> PlanInputs fields (the URL carries only the inputs, never results)
URL_KEYS = {"plan_gpu": "gpu", "plan_gpus": "gpus", "plan_ep": "ep", "plan_tp": "tp", "plan_dp": "dp_attention",
            "plan_batch": "batch", "plan_ctx": "context", "plan_engram": "engram"}
DEFAULT_INPUTS = PlanInputs(gpu="h200", gpus=8, ep=8, tp=1, dp_attention=False, batch=64, context=131072)
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
SEGMENT_COLOURS = {
    "attention": ROLE_COLOURS["full_m2"], "CSA2 extras": ROLE_COLOURS["reindex"], "routed experts": "#1B3A5C",
    "gate + shared expert": "#4F7CAC", "mHC + norms": "#7F63B8", "Engram projection": "#66C2A5",
    "Engram tables": "#009E73", "embedding + head": "#8C8C8C", "vision tower": "#C7C7C7", "DSpark": "#CC79A7",
    "global KV": "#D55E00", "index keys": "#E69F00", "sliding windows": "#F0B27A",
    "pending compressor state": "#F5CBA7", "activations (one prefill chunk)": "#56B4E9",
    "runtime reserve": "#D9D9D9", "free": "#F3F4F6"}


# -- inputs: URL and sessions ---------------------------------------------------------------------

def _coerce(name: str, raw: Any) -> Any:
    kind = {f.name: f.type for f in fields(PlanInputs)}[name]
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if str(raw).strip().lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if kind == "int":
        if isinstance(raw, bool):
            raise ValueError(raw)
        value = float(str(raw).strip().replace(",", "").replace("_", ""))
        if not value.is_integer():
            raise ValueError(raw)
        return int(value)
    return str(raw).strip().lower()


def inputs_from_mapping(values: Mapping[str, Any], cfg: ModelConfig, keys: Mapping[str, str] | None = None,
                        base: PlanInputs = DEFAULT_INPUTS) -> tuple[PlanInputs, list[str]]:
    """Plan inputs from URL query parameters (`keys` = URL_KEYS) or a session's stored dict (field names);
    a bad or impossible value falls back to the default, with a message naming it."""
    keys = keys if keys is not None else {f.name: f.name for f in fields(PlanInputs)}
    inputs, problems = base, []
    for key, name in keys.items():
        if key not in values or name not in URL_KEYS.values():
            continue
        raw = values[key]
        raw = raw[-1] if isinstance(raw, (list, tuple)) and raw else raw
        try:
            candidate = replace(inputs, **{name: _coerce(name, raw)})
            check_inputs(cfg, candidate)
        except (ValueError, PlanError) as err:
            why = f" ({err})" if isinstance(err, PlanError) else ""
            problems.append(f"Serving plan: {key}={raw!r} is not usable{why}; keeping {getattr(inputs, name)!r}.")
            continue
        inputs = candidate
    return inputs, problems


def inputs_to_query(inputs: PlanInputs) -> dict[str, str]:
    """The URL parameters that reproduce the inputs (all of them, so a link is explicit)."""
    out = {}
    for key, name in URL_KEYS.items():
        value = getattr(inputs, name)
        out[key] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def session_settings(inputs: PlanInputs) -> dict[str, Any]:
    """What a saved session keeps of the view, inside its "view" dict: {"plan": {field: value}}."""
    return {"plan": {name: getattr(inputs, name) for name in URL_KEYS.values()}}


def inputs_from_session(view: Mapping[str, Any] | None, cfg: ModelConfig) -> tuple[PlanInputs, list[str]] | None:
    """The inputs a session stored (None when it stored none)."""
    stored = (view or {}).get("plan")
    if not isinstance(stored, Mapping):
        return None
    return inputs_from_mapping(stored, cfg)


def tp_choices(cfg: ModelConfig, gpus: int) -> list[int]:
    """TP degrees this model splits evenly that divide the GPU count."""
    return [d for d in range(1, gpus + 1) if gpus % d == 0
            and all(n % d == 0 for n in (cfg.n_heads, cfg.o_groups, cfg.index_n_heads, cfg.vocab_size))]


def ep_choices(cfg: ModelConfig, gpus: int) -> list[int]:
    return [d for d in range(1, gpus + 1) if gpus % d == 0 and cfg.n_routed_experts % d == 0]


# -- figures and tables ---------------------------------------------------------------------------

def memory_segments(plan: Plan) -> list[tuple[str, str, float]]:
    """(kind, name, bytes per GPU) in drawing order, free room last (0 when it does not fit)."""
    return plan.memory.segments() + [("free", "free", max(0.0, plan.memory.free))]


def memory_figure(plan: Plan, height: int = 230) -> Figure:
    """One stacked bar of what each GPU holds, the HBM size marked; an overflow shows past the line."""
    m = plan.memory
    fig = Figure()
    for kind, name, nbytes in memory_segments(plan):
        if nbytes <= 0:
            continue
        fig.add_trace(dict(type="bar", orientation="h", x=[nbytes / 1e9], y=["per GPU"], name=name,
                           marker=dict(color=SEGMENT_COLOURS.get(name, MUTED),
                                       line=dict(color=GRID if kind == "free" else "white", width=0.5)),
                           customdata=[[kind]],
                           hovertemplate=f"{name}: %{{x:,.2f}} GB<extra>{kind}</extra>"))
    fig.add_vline(x=m.hbm / 1e9, line=dict(color=INK, width=2, dash="dot"))
    fig.add_annotation(x=m.hbm / 1e9, y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                       text=f"HBM {m.hbm / 1e9:,.0f} GB", font=dict(size=11, color=INK))
    top = max(m.hbm, m.used) / 1e9 * 1.04
    fig.update_layout(**base_layout(
        height=height, barmode="stack", showlegend=True, margin=dict(l=64, r=12, t=26, b=40),
        legend=dict(orientation="h", y=-0.35, yanchor="top", x=0, font=dict(size=10), traceorder="normal"),
        xaxis=dict(range=[0, top], title=dict(text="GB per GPU", font=dict(size=11, color=MUTED)),
                   gridcolor=GRID, tickfont=dict(size=10)),
        yaxis=dict(tickfont=dict(size=11)), hovermode="closest"))
    return fig


def roofline_rows(phase: Phase) -> list[dict[str, Any]]:
    """The per-role table: per layer FLOPs, bytes, link bytes, time and the limiting resource."""
    out = []
    for r in phase.rows:
        out.append({"role": r.role, "layers": _ranges(r.layers) or "-", "GFLOP / layer": round(r.flops / 1e9, 2),
                    "HBM / layer": fmt_bytes(r.hbm_bytes), "link / layer": fmt_bytes(r.link_bytes),
                    "µs / layer": round(r.time_s * 1e6, 1), "limit": r.limit,
                    "share of step": f"{r.total_s / phase.time_s:.0%}" if phase.time_s else "-"})
    return out


def _ranges(layers: list[int]) -> str:
    """[3, 4, 5, 7] -> '3-5, 7'."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def context_points(cfg: ModelConfig, points: int = 36) -> list[int]:
    """Log-spaced context lengths from 1,024 tokens to the model's maximum."""
    lo, hi = 1024, model_max_context(cfg)
    return sorted({int(round(lo * (hi / lo) ** (i / (points - 1)))) for i in range(points)})


def batch_series(cfg: ModelConfig, tally: Tally, inputs: PlanInputs, gpus: tuple[str, ...] = tuple(GPUS)) -> dict:
    """Largest batch that fits at each context length, for each GPU model in the same layout."""
    xs = context_points(cfg)
    out = {"context": xs}
    for key in gpus:
        p = replace(inputs, gpu=key)
        weights = weights_per_gpu(cfg, tally, p)
        out[key] = [largest_batch(cfg, tally, p, c, weights) for c in xs]
    return out


GPU_COLOURS = {"h100": "#A6A6A6", "h200": "#0072B2", "b200": "#009E73", "mi300x": "#D55E00"}


def batch_figure(series: dict, inputs: PlanInputs, height: int = 300) -> Figure:
    """Largest batch against context (log-log): one line per GPU model, the picked one bold, the
    inputs' (context, batch) marked."""
    fig = Figure()
    for key in GPUS:
        if key not in series:
            continue
        ys = [b if b > 0 else None for b in series[key]]
        picked = key == inputs.gpu
        fig.add_trace(dict(type="scatter", x=series["context"], y=ys, mode="lines", name=GPUS[key].name,
                           line=dict(color=GPU_COLOURS.get(key, MUTED), width=3 if picked else 1.4,
                                     dash="solid" if picked else "dot"),
                           hovertemplate=f"{GPUS[key].name}: batch %{{y:,}} at %{{x:,}} tokens<extra></extra>"))
    fig.add_trace(dict(type="scatter", x=[inputs.context], y=[inputs.batch], mode="markers", name="this plan",
                       marker=dict(size=11, color=INK, symbol="x"),
                       hovertemplate="batch %{y:,} at %{x:,} tokens<extra>this plan</extra>"))
    fig.update_layout(**base_layout(
        height=height, showlegend=True, margin=dict(l=62, r=8, t=8, b=44),
        legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0, font=dict(size=11)),
        xaxis=dict(type="log", title=dict(text="context length (tokens)", font=dict(size=11, color=MUTED)),
                   gridcolor=GRID, tickfont=dict(size=10)),
        yaxis=dict(type="log", title=dict(text="largest batch that fits", font=dict(size=11, color=MUTED)),
                   gridcolor=GRID, tickfont=dict(size=10)),
        hovermode="closest"))
    return fig


def headline(plan: Plan) -> list[tuple[str, str, str]]:
    """(label, value, help) for the metrics row."""
    m, i = plan.memory, plan.inputs
    return [
        ("Fits" if m.fits else "Does not fit", f"{m.used / 1e9:,.1f} / {m.hbm / 1e9:,.0f} GB",
         f"{m.sequences_per_gpu} sequence(s) per GPU; {fmt_bytes(max(m.free, 0))} free"),
        ("Largest batch", f"{plan.largest_batch:,}", f"at {i.context:,} tokens of context"),
        ("Longest context", fmt_tokens(plan.largest_context) if plan.largest_context else "0",
         f"{plan.largest_context:,} tokens at batch {i.batch}"),
        ("Decode ≤", f"{plan.tokens_per_s:,.0f} tok/s", f"{1 / plan.decode.time_s:,.1f} per sequence; step "
         f"{plan.decode.time_s * 1e3:.2f} ms, limited by {plan.decode.limit}"),
        ("First token ≥", f"{plan.ttft_s:,.2f} s", f"prefill of {i.context:,} tokens in chunks of {i.chunk:,}"),
    ]


# -- measured beside predicted --------------------------------------------------------------------

def first_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The backbone's first n layers (what benches/parallel.py runs with --layers n): lists cut to them,
    no DSpark, no candidate pool unless its source is kept."""
    keep = [i for i, layer in enumerate(cfg.engram_layer_ids) if layer < n]
    return cfg.replace(
        n_layers=n, n_mtp_layers=0, compress_ratios=cfg.compress_ratios[:n],
        kv_source_layers=tuple(x for x in cfg.kv_source_layers if x < n),
        index_source_layers=tuple(x for x in cfg.index_source_layers if x < n),
        candidate_source_layer=cfg.candidate_source_layer if cfg.candidate_source_layer < n else -1,
        engram_layer_ids=tuple(cfg.engram_layer_ids[i] for i in keep),
        engram_num_embeddings=tuple(cfg.engram_num_embeddings[i] for i in keep),
        dspark_target_layer_ids=tuple(x for x in cfg.dspark_target_layer_ids if x < n))


def bench_runs(results_dir: Path = RESULTS_DIR) -> list[dict]:
    """benches/parallel.py's stored runs (release-size layers on real GPUs); [] when there are none."""
    runs = []
    for path in sorted(Path(results_dir).glob("parallel-*.json")):
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(run, dict) and not run.get("smoke") and run.get("layers") and run.get("world"):
            runs.append({**run, "file": path.name})
    return runs


def bench_inputs(run: dict) -> PlanInputs:
    """The layout the bench ran: heads and experts over every process, one prompt as one chunk."""
    world, tokens = int(run["world"]), int(run["tokens"])
    device = str(run.get("device", "")).lower()
    gpu = next((key for key in GPUS if key in device.replace(" ", "")), "h200")
    return PlanInputs(gpu=gpu, gpus=world, ep=world, tp=world, batch=1, context=tokens, chunk=tokens,
                      engram="host", dspark=False, vision=False, reserve=0.0)


def measured_vs_predicted(cfg: ModelConfig, run: dict) -> dict:
    """One stored bench run beside the plan of its layout: per-layer prefill time and FLOPs, and the
    weights each GPU held (the bench keeps no Engram table, DSpark, vision tower or image markers)."""
    sub = first_layers(cfg, int(run["n_layers"])) if int(run["n_layers"]) < cfg.n_layers else cfg
    tally = tally_from_config(sub)
    p = bench_inputs(run)
    gpu = GPUS[p.gpu]
    boxes = layer_boxes(tally)
    plan = {r.layer: r for r in role_plan(sub)[: sub.n_layers]}
    rows = []
    for m in run["layers"]:
        r = plan[int(m["layer"])]
        w = layer_work(sub, r, boxes[r.layer], p, tokens=p.chunk, total_tokens=p.chunk, sequences=1,
                       position=p.context, decode=False)
        t, limit, _ = w.time(gpu)
        rows.append({"layer": r.layer, "role": m["role"], "predicted ms": round(t * 1e3, 3),
                     "measured ms": round(m["time_s"] * 1e3, 1), "of bound": f"{t / m['time_s']:.2%}",
                     "limit": limit, "GFLOP (plan)": round(sum(w.flops.values()) / 1e9, 1),
                     "GFLOP (bench)": m.get("gflop_per_gpu")})
    markers = sum(r.total_bytes for r in tally.rows if r.box.startswith("embed.image"))
    predicted = sum(weights_per_gpu(sub, tally, p).values()) - markers
    held = [mem.get("resident_weights_bytes") for mem in run.get("memory", []) if mem.get("resident_weights_bytes")]
    return {"file": run["file"], "device": run.get("device"), "world": p.gpus, "tokens": p.context,
            "n_layers": sub.n_layers, "rows": rows, "predicted_weights": predicted,
            "measured_weights": held[0] if held else None,
            "predicted_total_ms": sum(r["predicted ms"] for r in rows),
            "measured_total_ms": sum(r["measured ms"] for r in rows)}


def live_cache(cfg: ModelConfig, run: Mapping[str, Any] | None) -> dict | None:
    """A live run's cache bytes (the engine's own count) beside the plan's one sequence at its length,
    with the compressors' pending tokens counted exactly (C mod m)."""
    if not run or "cache_bytes" not in run:
        return None
    n = len(run.get("token_ids") or run.get("tokens") or [])
    held = run["cache_bytes"] if isinstance(run["cache_bytes"], Mapping) else {"total": int(run["cache_bytes"])}
    one = cache_per_sequence(cfg, n, dspark=False, exact_pending=True)
    predicted = {"global": one["global KV"] + one["index keys"], "window": one["sliding windows"],
                 "pending": one["pending compressor state"]}
    predicted["total"] = sum(predicted.values())
    rows = [{"cache": k, "plan (bytes)": predicted[k], "engine held (bytes)": held.get(k)}
            for k in ("global", "window", "pending", "total")]
    return {"tokens": n, "rows": rows, "match": all(r["engine held (bytes)"] in (None, r["plan (bytes)"]) for r in rows)}
