"""benches/release_layer.py's decode step as a CUDA graph: capture, replay, the host syncs found on the way."""

from __future__ import annotations

import gc
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

GOAL_RATIO = 3.0


@contextmanager
def listed_host_syncs(found: list | None, device):
    """Record the host syncs of the enclosed CUDA work into `found` (torch's sync debug mode warns at
    each; the warning names the Python line that asked); no-op for None or off the GPU."""
    if found is None or device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += sorted({f"{Path(w.filename).name}:{w.lineno}" for w in caught
                     if "synchronizing CUDA operation" in str(w.message)})


@contextmanager
def profiled(reports: dict | None, phase: str, device):
    """Profile the enclosed work into reports[phase] (engine.profiling's tables); no-op for None."""
    if reports is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    from engine.profiling import profile_report
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
    reports[phase] = profile_report(prof, cuda)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_decode(block, x, pre, positions, shared, step, device, profiles: dict | None = None,
                 replays: int = 20) -> dict:
    """The layer's decode step captured once as a CUDA graph and replayed: what a serving loop pays per
    step when the host is out of the way. The Engram hashes its n-grams and gathers its table rows
    inside the graph, its n-gram history kept on the device (the engine's own loop keeps it on the CPU
    and looks up on the host). Every live CUDA tensor is held while the graph lives (a graph reads its
    inputs by address). -> {"graph_s": mean of `replays` replays back to back, "graph_single_s":
    median of single replays, each timed alone, "graph_out", "graph_peak"}
    or {"graph_error": why}. profiles: a dict to receive one more replay's profile ("decode graph": the
    kernels the graph runs, which differ from the eager step's where a host branch has a branch-free form)."""
    out = {}
    if device.type != "cuda":
        return {"graph_error": "CUDA graphs need a GPU"}
    if block.engram is not None:  # the n-gram history kept on the device: hashing and gather in the graph
        ids, dead, (hist_ids, hist_dead) = step
        step = (ids, dead, (hist_ids.to(device), hist_dead.to(device)))
        block.engram.lookup(*step, device)  # once before capture: its constants copied to the device
    held = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.is_cuda]
    try:
        g = torch.cuda.CUDAGraph()
        _sync(device)
        with torch.cuda.graph(g):
            y, _ = block.forward(x, pre, positions, shared, step, None, None)
        g.replay()
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        # back to back: the host's launch of one replay overlaps the GPU's run of the one before, as
        # the layers of a whole-step graph would (a single replay also waits for its own launch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        out.update(graph_s=start.elapsed_time(end) / 1e3 / replays, graph_single_s=sorted(times)[len(times) // 2],
                   graph_out=y.clone(), graph_peak=torch.cuda.max_memory_allocated(device))
        with profiled(profiles, "decode graph", device):
            g.replay()
            _sync(device)
    except Exception as err:  # noqa: BLE001 -- reported in the row, the eager figures still stand
        out["graph_error"] = f"{type(err).__name__}: {err}".replace("\n", " ")[:400]
    finally:
        del held
    return out


def graph_row(graph: dict, eager_out, floor_s: float) -> dict:
    """The decode row's CUDA-graph figures: replay time, its ratio to the floor, and the largest
    difference from the eager step's output (relative to its largest value)."""
    if not graph:
        return {}
    if "graph_error" in graph:
        return {"graph_error": graph["graph_error"]}
    ratio = graph["graph_s"] / floor_s
    diff = None
    if eager_out is not None:
        diff = float((graph["graph_out"].float() - eager_out.float()).abs().max() / eager_out.float().abs().max())
    return {"graph_s": graph["graph_s"], "graph_single_s": graph["graph_single_s"], "graph_ratio": ratio,
            "graph_goal_met": ratio <= GOAL_RATIO, "graph_rel_diff": diff,
            "graph_peak": graph["graph_peak"]}


def graph_table(rows: list[dict]) -> list[str]:
    """The report's lines for the decode rows' graph figures (none when no row has any)."""
    graphed = [r for r in rows if r.get("status") == "ok" and r["phase"] == "decode"
               and ("graph_s" in r or "graph_error" in r or r.get("host_syncs"))]
    if not graphed:
        return []
    lines = ["", "Decode step as one CUDA graph (captured after the warm pass; graph: the mean of 20 replays "
              "back to back, the layer's share of a whole-step graph; one replay: the median of 20 replays "
              "each timed alone, its own launch included; the Engram hashes and gathers inside the graph, its "
              "n-gram history on the device; host syncs: where the eager step waits on the GPU, by CUDA's "
              "sync debug mode on the first pass; under capture each is a branch-free form):", "",
              "| role | layer | eager (ms) | graph (ms) | one replay (ms) | x floor | goal | vs eager output | "
              "host syncs |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in graphed:
        syncs = "; ".join(r.get("host_syncs") or []) or "none"
        if "graph_s" not in r:
            lines.append(f"| {r['title']} | {r['layer']} | {r['time_s'] * 1e3:.2f} | "
                         f"{r.get('graph_error', 'not run')[:160]} | - | - | - | - | {syncs} |")
            continue
        diff = "-" if r["graph_rel_diff"] is None else f"{r['graph_rel_diff']:.1e}"
        lines.append(f"| {r['title']} | {r['layer']} | {r['time_s'] * 1e3:.2f} | {r['graph_s'] * 1e3:.3f} | "
                     f"{r['graph_single_s'] * 1e3:.3f} | {r['graph_ratio']:.1f} | "
                     f"{'met' if r['graph_goal_met'] else 'missed'} | {diff} | {syncs} |")
    return lines
