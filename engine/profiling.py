"""Profiles read for people: where a step's (or a layer's) GPU time goes. Used by the trainer's profiled
step (engine/train/loop.py) and the release-size layer bench (benches/release_layer.py)."""

from __future__ import annotations


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
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    lines += ["", averages.table(sort_by=key, row_limit=40)]
    if cuda:  # where the host's time goes (launch-bound stretches, synchronizing calls)
        lines += ["", "ops by the host's own time", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    return {"kernel_s": kernel_us / 1e6, "busy_s": busy / 1e6, "span_s": span / 1e6, "launches": len(kernels),
            "text": "\n".join(lines)}
