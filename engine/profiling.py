"""Profiles read for people: where a step's (or a layer's) GPU time goes. Used by the trainer's profiled
step (engine/train/loop.py) and the release-size layer bench (benches/release_layer.py)."""

from __future__ import annotations

import re


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    busy, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy


def _on_gpu(event) -> bool:
    from torch.autograd import DeviceType
    return event.device_type == DeviceType.CUDA


def kernel_events(events) -> list:
    """The GPU kernels among a profile's events: not the GPU-side copies of named ranges (`part.*`
    record_function ranges), whose spans would count every kernel inside them, and the idle time
    between, a second time."""
    return [e for e in events if _on_gpu(e) and not getattr(e, "is_user_annotation", False)]


def idle_gaps(kernels, host_events, top: int = 12, min_us: float = 20.0) -> list[dict]:
    """The longest stretches with no kernel running (each at least min_us), longest first: the gap, the
    kernels either side, and the host's innermost ops busiest during it (what the GPU waited for: a synchronizing
    call, or launches slower than the kernels they feed). Times in us, on the profiler's one clock."""
    gaps, end, last = [], None, None
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        lo, hi = e.time_range.start, e.time_range.end
        if end is not None and lo - end >= min_us:
            gaps.append({"us": lo - end, "start": end, "end": lo, "before": last.name, "after": e.name})
        if end is None or hi > end:
            end, last = hi, e
    gaps.sort(key=lambda g: -g["us"])

    def innermost(e) -> bool:  # a leaf (a runtime call), or an aten op with no aten op inside
        children = getattr(e, "cpu_children", None) or []
        return not children or e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in children)
    leaves = [e for e in host_events if innermost(e)]
    for g in gaps[:top]:
        overlap: dict[str, float] = {}
        for e in leaves:
            o = min(e.time_range.end, g["end"]) - max(e.time_range.start, g["start"])
            if o > 0:
                overlap[e.name] = overlap.get(e.name, 0.0) + o
        g["host"] = sorted(overlap.items(), key=lambda kv: -kv[1])[:4]
    return gaps[:top]


def _gap_table(gaps: list[dict], idle_us: float) -> list[str]:
    lines = ["", f"GPU idle: {idle_us / 1e3:.2f} ms inside the span; the longest gaps, with the host's innermost "
             "ops busiest in each (us of overlap)", "", "| gap (us) | after kernel | before kernel | host ops |",
             "|---|---|---|---|"]
    for g in gaps:
        host = "; ".join(f"{name[:40]} {us:.0f}" for name, us in g["host"]) or "-"
        lines.append(f"| {g['us']:.0f} | {g['before'][:50]} | {g['after'][:50]} | {host} |")
    return lines


def _where(event, frame: re.Pattern) -> str:
    """The two innermost Python frames above an op that `frame` matches (`with_stack` profiles record the
    frames as the op's ancestors, named by their paths from sys.path and the line where the function starts;
    some versions also keep them as the op's own stack), as path:function; "-" without them."""
    frames, op = [], event
    while event is not None and len(frames) < 2:
        m = frame.search(event.name)
        if m:
            frames.append(f"{m.group(1)}:{m.group(2)}")
        event = event.cpu_parent
    for entry in getattr(op, "stack", None) or []:
        m = frame.search(entry)
        if m and len(frames) < 2:
            frames.append(f"{m.group(1)}:{m.group(2)}")
    return " < ".join(frames) or "-"


def kineto_dtypes(prof) -> dict[int, list[str]]:
    """Each copy's input dtypes by event id, read from the profiler's raw events: the events of torch
    builds before 2.13 carry shapes but no dtypes (the device's 2.11 left run 30a's copy table without them)."""
    try:
        raw = prof.profiler.kineto_results.events()
    except AttributeError:
        return {}
    return {k.correlation_id(): list(k.dtypes()) for k in raw if k.name() == "aten::copy_"}


def copy_rows(events, cuda: bool, top: int = 20, roots: tuple[str, ...] = ("engine/", "kernels/", "benches/"),
              dtypes_by_id: dict[int, list[str]] | None = None) -> list[dict]:
    """Every tensor copy of a profile (`aten::copy_`: a `.to`, `.float()`, `.contiguous()`, a slice
    assignment), grouped by source and destination dtype, shape and the frames of files under the path
    prefixes `roots` that made it, the most GPU (or CPU) time first: the glue a fused kernel or a kept dtype
    could drop. Dtypes and shapes need `record_shapes`, frames `with_stack`; `dtypes_by_id` (`kineto_dtypes`)
    stands in for events without dtypes."""
    key = "device_time_total" if cuda else "cpu_time_total"
    # a frame's path is relative to its sys.path entry, or absolute where none holds it
    frame = re.compile(rf"(?:^|/)((?:{'|'.join(map(re.escape, roots))})[\w./]*\.py)\(\d+\): (\S+)")
    rows: dict[tuple, dict] = {}
    for e in events:
        if _on_gpu(e) or e.name != "aten::copy_":
            continue
        shapes = getattr(e, "input_shapes", None) or []
        dtypes = getattr(e, "input_dtypes", None) or (dtypes_by_id or {}).get(e.id, [])
        what = (f"{_short(dtypes[1])} -> {_short(dtypes[0])}" if len(dtypes) >= 2 else "?") + \
            (" " + "x".join(map(str, shapes[1])) if len(shapes) >= 2 and shapes[1] else "")
        where = _where(e, frame)
        row = rows.setdefault((what, where), {"copy": what, "where": where, "calls": 0, "us": 0.0})
        row["calls"] += 1
        row["us"] += getattr(e, key)
    return sorted(rows.values(), key=lambda r: -r["us"])[:top]


def _short(dtype: str) -> str:
    return {"c10::BFloat16": "bf16", "float": "f32", "c10::Half": "f16", "long int": "i64", "int": "i32",
            "unsigned char": "u8", "c10::Float8_e4m3fn": "e4m3"}.get(dtype, dtype)


def _copy_table(rows: list[dict], cuda: bool, frames: int) -> list[str]:
    unit = "GPU" if cuda else "CPU"
    lines = ["", f"copies (aten::copy_) by source -> destination dtype, shape and caller, by {unit} time "
             f"({frames} events with Python frames: frame events, or ops carrying their stack)", "",
             f"| copy | where | calls | {unit} ms |", "|---|---|---|---|"]
    return lines + [f"| {r['copy']} | {r['where']} | {r['calls']} | {r['us'] / 1e3:.3f} |" for r in rows]


def profile_report(prof, cuda: bool) -> dict:
    """Tables of one profiled step: named parts and autograd nodes by the kernel time launched inside
    them, kernels by name, ops by their own time; the kernels' total, their count, and the GPU's busy
    time (the union of kernel intervals, so overlapping streams are not counted twice)."""
    kernels = kernel_events(prof.events()) if cuda else []
    kernel_us = sum(e.device_time_total for e in kernels)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy = busy_time(spans)
    span = (max(hi for _, hi in spans) - min(lo for lo, _ in spans)) if spans else 0.0
    averages = prof.key_averages()
    total_key = "device_time_total" if cuda else "cpu_time_total"
    # the host-side rows: a named part is also recorded as a GPU range (its span, idle gaps included)
    named = [r for r in averages if r.key.startswith(("part.", "autograd::engine::evaluate_function"))
             and not _on_gpu(r)]
    named.sort(key=lambda r: getattr(r, total_key), reverse=True)
    lines = ["parts of the forward (recomputes run inside the backward's nodes) and autograd nodes,",
             f"by the {'kernel' if cuda else 'CPU'} time inside them (nested parts count in both)", "",
             f"| part or node | calls | ms |", "|---|---|---|"]
    lines += [f"| {r.key.replace('autograd::engine::evaluate_function: ', 'backward: ')} | {r.count} | "
              f"{getattr(r, total_key) / 1e3:.1f} |" for r in named[:60]]
    if cuda:
        by_name: dict[str, list] = {}
        for e in kernels:
            entry = by_name.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time_total
        lines += ["", "kernels by name (top 60 by total time)", "", "| kernel | launches | ms | us each |",
                  "|---|---|---|---|"]
        for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:60]:
            lines.append(f"| {name[:110]} | {n} | {us / 1e3:.1f} | {us / n:.1f} |")
        lines += _gap_table(idle_gaps(kernels, [e for e in prof.events() if not _on_gpu(e)]), span - busy)
        # torch 2.13 records frames as events of their own; 2.11 (the device's), under the verbose config, as each
        # op's stack (run 30e's table: callers named, no frame event)
        frames = sum(1 for e in prof.events() if ".py(" in e.name or getattr(e, "stack", None))
        lines += _copy_table(copy_rows(prof.events(), cuda, dtypes_by_id=kineto_dtypes(prof)), cuda, frames)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    lines += ["", averages.table(sort_by=key, row_limit=40)]
    if cuda:  # where the host's time goes (launch-bound stretches, synchronizing calls)
        lines += ["", "ops by the host's own time", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    return {"kernel_s": kernel_us / 1e6, "busy_s": busy / 1e6, "span_s": span / 1e6, "launches": len(kernels),
            "text": "\n".join(lines)}
