"""benches/release_layer.py's phases on CUDA graphs: the whole layer's decode step (or prefill) captured and
replayed, the host syncs found on the way, the engine's own one-token decode loop eager and on its piecewise graphs
(engine/model/graphs.py); and the report's table."""

from __future__ import annotations

import gc
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from statistics import median

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
    # shapes and Python frames for the copy table (GPU only: under the interpreter every kernel's Python
    # would be recorded, past 24 GB for the tiny config's layer); the verbose config because the device's
    # torch 2.11 kept no frame with with_stack alone (run 30d's table: "0 Python frames recorded")
    from torch._C._profiler import _ExperimentalConfig
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), record_shapes=cuda,
                 with_stack=cuda, experimental_config=_ExperimentalConfig(verbose=cuda)) as prof:
        yield
    reports[phase] = profile_report(prof, cuda)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_phase(block, x, pre, positions, shared, step, device, phase: str = "decode", probe: dict | None = None,
                profiles: dict | None = None, replays: int = 20) -> dict:
    """The layer's decode step (or its prefill) captured once as a CUDA graph and replayed: what a serving
    loop pays per step when the host is out of the way (a prefill graph is what a server replays for a
    fixed-size chunk; its probes are written by every replay). The Engram hashes its n-grams and gathers
    its table rows inside the graph, its n-gram history kept on the device (the engine's own loop keeps it on the CPU
    and looks up on the host). Every live CUDA tensor is held while the graph lives (a graph reads its
    inputs by address). -> {"graph_s": mean of `replays` replays back to back, "graph_single_s":
    median of single replays, each timed alone, "graph_out", "graph_peak"}
    or {"graph_error": why}. profiles: a dict to receive one more replay's profile ("<phase> graph": the
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
            y, _ = block.forward(x, pre, positions, shared, step, None, probe)
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
        with profiled(profiles, f"{phase} graph", device):
            g.replay()
            _sync(device)
    except Exception as err:  # noqa: BLE001 -- reported in the row, the eager figures still stand
        out["graph_error"] = f"{type(err).__name__}: {err}".replace("\n", " ")[:400]
    finally:
        del held
    return out


def graph_row(graph: dict, eager_out, floor_s: float) -> dict:
    """A row's CUDA-graph figures: replay time, its ratio to the floor, and the largest difference from
    the eager phase's output (relative to its largest value)."""
    if not graph:
        return {}
    if "graph_error" in graph:
        return {"graph_error": graph["graph_error"]}
    ratio = graph["graph_s"] / floor_s
    diff = None
    if eager_out is not None:
        eager = eager_out.float().to(graph["graph_out"].device)
        diff = float((graph["graph_out"].float() - eager).abs().max() / eager.abs().max())
    return {"graph_s": graph["graph_s"], "graph_single_s": graph["graph_single_s"], "graph_ratio": ratio,
            "graph_goal_met": ratio <= GOAL_RATIO, "graph_rel_diff": diff,
            "graph_peak": graph["graph_peak"]}


def graph_table(rows: list[dict]) -> list[str]:
    """The report's lines for the rows' graph figures (none when no row has any): decode rows first."""
    graphed = [r for phase in ("decode", "prefill") for r in rows if r.get("status") == "ok" and r["phase"] == phase
               and ("graph_s" in r or "graph_error" in r or (phase == "decode" and r.get("host_syncs")))]
    if not graphed:
        return []
    lines = ["", "Each phase of the layer as one CUDA graph (captured after the warm passes; graph: the mean of 20 "
              "replays back to back, the layer's share of a whole-step graph; one replay: the median of 20 replays "
              "each timed alone, its own launch included; the prefill's graph writes every probe; the Engram hashes "
              "and gathers inside the graph, its n-gram history on the device; host syncs: where the eager phase waits "
              "on the GPU, by CUDA's sync debug mode on a pass of its own; under capture each is a branch-free form):",
              "", "| role | layer | phase | eager (ms) | graph (ms) | one replay (ms) | x floor | goal | vs eager output | "
              "host syncs |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in graphed:
        syncs = "; ".join(r.get("host_syncs") or []) or "none"
        head = f"| {r['title']} | {r['layer']} | {r['phase']} {r['queries']} | {r['time_s'] * 1e3:.2f} | "
        if "graph_s" not in r:
            lines.append(head + f"{r.get('graph_error', 'not run')[:160]} | - | - | - | - | {syncs} |")
            continue
        diff = "-" if r["graph_rel_diff"] is None else f"{r['graph_rel_diff']:.1e}"
        lines.append(head + f"{r['graph_s'] * 1e3:.3f} | "
                     f"{r['graph_single_s'] * 1e3:.3f} | {r['graph_ratio']:.1f} | "
                     f"{'met' if r['graph_goal_met'] else 'missed'} | {diff} | {syncs} |")
    return lines


def stream_inputs(model, cfg, n: int, device, seed: int):
    """What every layer of a chain is fed at n positions: token ids [n] (the Engram's), a random stream
    [n, hc, dim] (the numerics' activation) and uniform collapse weights [n, hc]."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (n,), device=device, generator=g)
    x0 = model.ops.act(torch.randn(n, cfg.hc_mult, cfg.dim, device=device, generator=g))
    if getattr(model.ops, "_narrow_stream", False):  # knob stream_bf16: the stream as a model's later layers get it
        x0 = x0.bfloat16()
    return ids, x0, torch.full((n, cfg.hc_mult), 1.0 / cfg.hc_mult, device=device)


def decode_loop(model, cfg, layers: list[int], tokens: int, steps: int, device, graphs=None) -> dict:
    """The engine's own decode at release size: a `tokens` prefill of the chain `layers`, then `steps`
    one-token steps through it as Model.run_chunk runs them (the Engram's history on the host), eager and then
    on the engine's piecewise CUDA graphs (each after a prefill of its own). The last layer's step is timed
    with its host work (a sync before and after): the median over the steps after the graphs' recording (the
    first two). graphs: the `pieces` to run (default: a new DecodeGraphs; tests pass a stand-in on the CPU).
    -> {"loop_eager_s", "loop_graphs_s", "loop_recorded", "loop_refused", "loop_rel_diff", "loop_steps"}."""
    from engine.model.attention import Shared
    from engine.model.graphs import DecodeGraphs
    if graphs is None and device.type != "cuda":
        return {"loop_error": "CUDA graphs need a GPU"}
    target, n = layers[-1], tokens + steps
    ids, x0, pre0 = stream_inputs(model, cfg, n, device, seed=11)
    graphs = graphs if graphs is not None else DecodeGraphs(device, forget=model.forget_rounding)
    out, outputs = {}, {}
    for mode, pieces in (("eager", None), ("graphs", graphs)):
        model.reset()
        history = (model.compressed_history, model.dead_history)
        times, ys = [], []
        for rows in [slice(0, tokens)] + [slice(t, t + 1) for t in range(tokens, n)]:
            shared, chunk_ids = Shared(), ids[rows]
            positions, dead = torch.arange(rows.start, rows.stop, device=device), torch.zeros_like(chunk_ids, dtype=torch.bool)
            for L in layers:
                x, pre = x0[rows].clone(), pre0[rows].clone()
                _sync(device)
                started = time.perf_counter()
                y, _ = model.blocks[L].forward(x, pre, positions, shared, (chunk_ids, dead, history), None, None,
                                               pieces=pieces if rows.start >= tokens else None)
                _sync(device)
                if L == target and rows.start >= tokens:
                    times.append(time.perf_counter() - started)
                    ys.append(y)
            history = model.history_after(chunk_ids, dead)
        out[f"loop_{mode}_s"] = median(times[2:])
        outputs[mode] = torch.cat(ys).float()
    diff = (outputs["graphs"] - outputs["eager"]).abs().max() / outputs["eager"].abs().max()
    out.update(loop_recorded=graphs.recorded, loop_refused={f"{k[0]}:{k[1]}": why for k, why in graphs.refused.items()},
               loop_rel_diff=float(diff), loop_steps=steps)
    return out


def loop_table(rows: list[dict]) -> list[str]:
    """The report's lines for the engine's decode loop (none when no row has it)."""
    looped = [r for r in rows if r.get("status") == "ok" and r["phase"] == "decode"
              and ("loop_eager_s" in r or "loop_error" in r)]
    if not looped:
        return []
    lines = ["", "The engine's own decode loop, one token a step (the last layer of the chain; its step with the host's "
             "work, a sync before and after; the median of the steps after the graphs' recording; graphs: the engine's "
             "piecewise CUDA graphs, engine/model/graphs.py, the caches' reads and growth eager between them):", "",
             "| role | layer | steps | eager (ms) | piecewise graphs (ms) | x | pieces recorded | refused | vs eager |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in looped:
        if "loop_eager_s" not in r:
            lines.append(f"| {r['title']} | {r['layer']} | - | {r['loop_error']} | - | - | - | - | - |")
            continue
        refused = "; ".join(f"{k} {v}" for k, v in r["loop_refused"].items())[:200] or "none"
        lines.append(f"| {r['title']} | {r['layer']} | {r['loop_steps']} | {r['loop_eager_s'] * 1e3:.3f} | "
                     f"{r['loop_graphs_s'] * 1e3:.3f} | {r['loop_eager_s'] / r['loop_graphs_s']:.2f} | "
                     f"{r['loop_recorded']} | {refused} | {r['loop_rel_diff']:.1e} |")
    return lines


def later_passes(run_pass, ops, args, pass_s: float | None, deadline: float, device, loop=None) -> dict:
    """The passes after the timed ones, each while the deadline leaves time for it (pass_s: a warm pass's seconds;
    None: there was no warm pass, so none runs): the host syncs (a pass of their own: the first pass's include
    weight uploads and compiles, and sync debug mode's warnings are host work inside a timed span: run 24b's
    listed SWA + Engram prefill read 55.8 ms against 24.7 ms of profiled GPU span), the profile (--profile),
    each phase as a CUDA graph (--graph: a pass each, the decode's after an eager prefill), the knob A/B
    (--ab), the engine's own decode loop (--decode-loop: loop() runs it). run_pass(**kw): one of
    release_layer.py's passes (`run_role`). -> {"syncs", "profiles", "graphs", "ab", "loop"}."""
    out = {"syncs": {}, "profiles": {}, "graphs": {}, "ab": [], "loop": {}}
    if pass_s is None:
        return out

    def time_for(passes: float) -> bool:
        return time.perf_counter() + pass_s * passes < deadline

    if device.type == "cuda" and time_for(1):
        run_pass(syncs=out["syncs"])
    if args.profile and time_for(3):
        run_pass(profiles=out["profiles"])
    for phase in ("decode", "prefill") if args.graph else ():
        if time_for(2):
            out["graphs"][phase] = {}
            run_pass(profiles=out["profiles"] if args.profile else None, graphs={phase: out["graphs"][phase]})
    if args.ab and time_for(4 * (len(args.ab) + 1)):
        out["ab"] = knob_ab(ops, args.ab, lambda graphs=None: run_pass(graphs=graphs))
    if args.decode_loop and loop is not None and time_for(4):
        out["loop"] = loop()
    return out


def knob_ab(ops, variants: list[str], run_pass) -> list[dict]:
    """A role's figures under each kernel-ops knob spec ("" first: the defaults, the baseline of the same run):
    a pass for the variant's compiles, then each phase captured as a graph where possible, else timed eagerly on
    a pass after the compiling one; the knobs restored after each. run_pass(graphs=None): one of
    release_layer.py's passes (`run_role`). -> [{"knobs", "prefill", "decode" (seconds), "prefill_how",
    "decode_how" ("graph" / "eager")} or {"knobs", "error"}]."""
    def measure() -> dict:
        run_pass()
        figures, eager = {}, None
        for phase in ("prefill", "decode"):
            one = {phase: {}}
            run_pass(graphs=one)
            if "graph_s" in one[phase]:
                figures.update({phase: one[phase]["graph_s"], f"{phase}_how": "graph"})
            else:
                eager = eager or run_pass()
                figures.update({phase: eager[f"{phase}_s"], f"{phase}_how": "eager"})
        return figures

    if not hasattr(ops, "set_knobs"):
        return [{"knobs": "; ".join(variants), "error": f"{type(ops).__name__} has no knobs: the kernel ops do"}]
    out = []
    for spec in [""] + [v for v in variants if v]:
        before = {name: getattr(ops, name) for name in ops.KNOBS}
        try:
            ops.set_knobs(spec)
            out.append({"knobs": spec or "defaults", **measure()})
        except Exception as err:  # noqa: BLE001 -- one variant's failure is its row's, not the role's
            out.append({"knobs": spec, "error": f"{type(err).__name__}: {err}".replace("\n", " ")[:300]})
        finally:
            for name, value in before.items():
                setattr(ops, name, value)
    return out


def ab_table(rows: list[dict]) -> list[str]:
    """The report's lines for --ab (none without it): each variant's time and its ratio to the defaults'."""
    roles = [r for r in rows if r.get("status") == "ok" and r.get("ab")]
    if not roles:
        return []
    lines = ["", "Kernel-ops knobs A/B, each role in one process (the defaults measured beside the variants; graph: "
             "the phase captured and replayed, 20 back to back; eager where graphs are not possible):", "",
             "| role | knobs | prefill (ms) | x defaults | decode (ms) | x defaults | how |", "|---|---|---|---|---|---|---|"]
    for r in roles:
        base = r["ab"][0]
        for v in r["ab"]:
            if "error" in v:
                lines.append(f"| {r['title']} | {v['knobs']} | {v['error'][:160]} | - | - | - | - |")
                continue
            cells = [f"{v[p] * 1e3:.3f} | {v[p] / base[p]:.3f}" if base.get(p) else f"{v[p] * 1e3:.3f} | -"
                     for p in ("prefill", "decode")]
            lines.append(f"| {r['title']} | {v['knobs']} | {cells[0]} | {cells[1]} | "
                         f"{v['prefill_how']} / {v['decode_how']} |")
    return lines


def table(report: dict) -> str:
    r = report["rates"]
    lines = [f"# Release-size layers, {report['device']}",
             "",
             f"{report['config']}; prefill {report['tokens']} tokens with every probe, decode step "
             f"{report['decode']} tokens; weights: {report['weights']}; ops: {report['ops']}. "
             f"Rates measured in this run: FP8 GEMM (torch._scaled_mm {r['fp8_gemm_n']}^3) "
             f"{r['fp8_flops'] / 1e12:.4g} TFLOP/s, copy {r['hbm_Bps'] / 1e12:.4g} TB/s. "
             f"Floor = max(FLOPs / FP8 rate, bytes / copy rate); goal: time within {GOAL_RATIO:g}x of it.",
             "",
             "| role | layer | phase | time (ms) | GFLOP | MB | floor (ms) | limit | x floor | goal | peak (GB) | experts | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['title']} | {row.get('layer', '-')} | - | - | - | - | - | - | - | - | - | - | "
                         f"{row['status']}: {row.get('error', '')[:160]} |")
            continue
        peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 1e9:.1f}"
        note = ("" if row["warm"] else "first pass (compiles included); ") + f"chain {row['chain']}"
        if row["phase"] == "prefill" and row.get("host_syncs"):  # (the decode step's: the graph table)
            note += f"; host syncs {', '.join(row['host_syncs'])}"
        prof = row.get("profile") or {}
        if prof.get("span_s"):  # the profiled pass (GPU only): where the time went, the gaps table in the profile
            note += (f"; profiled: kernels {prof['kernel_s'] * 1e3:.2f} ms, GPU idle "
                     f"{(prof['span_s'] - prof['busy_s']) * 1e3:.2f} of {prof['span_s'] * 1e3:.2f} ms")
        lines.append(f"| {row['title']} | {row['layer']} | {row['phase']} {row['queries']} | {row['time_s'] * 1e3:.2f} | "
                     f"{row['flops'] / 1e9:.4g} | {row['bytes'] / 1e6:.4g} | {row['floor_s'] * 1e3:.4g} | {row['limit']} | "
                     f"{row['ratio']:.1f} | {'met' if row['goal_met'] else 'missed'} | {peak} | {row['touched_experts']} | {note} |")
    lines += graph_table(report["rows"]) + loop_table(report["rows"]) + ab_table(report["rows"])
    lines += ["", f"Total wall time {report['wall_s']:.1f} s (budget {report['budget_s']:g} s)."]
    return "\n".join(lines) + "\n"
