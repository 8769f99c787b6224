"""What the kernel benches share: the device, the run's log (rows and errors), timing (CUDA graphs for
decode-sized work), the ceilings measured in the run, configuration sweeps, and the eager FP4 decode."""

from __future__ import annotations

import contextlib

import torch
import triton

from engine import quant as Q

DEV = "cuda"
LOG: dict = {"rows": [], "errors": []}


def bench(fn, graph=False, rep=60):
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001
            LOG["errors"].append(f"graph capture failed, plain timing: {e!r}"[:300])
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3  # us


def ceilings():
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    a.random_()
    t = triton.testing.do_bench(lambda: b.copy_(a), rep=200, return_mode="median") * 1e-3
    bw = 2 * a.numel() / t
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: x @ y, rep=200, return_mode="median") * 1e-3
    return bw, 2 * 8192**3 / t


_TABLES: dict = {}


def fp4_dev(packed, scale, block):
    # the table is made once, so eager code can be captured in a CUDA graph
    table = _TABLES.get(packed.device)
    if table is None:  # not setdefault: its argument (a host-to-device copy) would run on every call
        table = _TABLES[packed.device] = Q.FP4_TABLE.to(packed.device)
    b = packed.view(torch.uint8)
    v = torch.stack([table[(b & 15).long()], table[(b >> 4).long()]], -1).flatten(-2)
    return (v.unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)).flatten(-2)


def rand_fp4(shape, block, kind="e8m0"):
    """Random packed FP4 with plausible scales, made on the GPU."""
    packed = torch.randint(-128, 128, (*shape[:-1], shape[-1] // 2), dtype=torch.int8, device=DEV)
    if kind == "e8m0":
        s = torch.randint(118, 130, (*shape[:-1], shape[-1] // block), dtype=torch.uint8, device=DEV)
        return packed, s.view(torch.float8_e8m0fnu)
    s = (torch.rand(*shape[:-1], shape[-1] // block, device=DEV) * 0.5 + 0.01).to(torch.float8_e4m3fn)
    return packed, s


def sweep(log_key: str, what: str, cfgs, run, check=None, valid=None, **bench_kw):
    """Time run(**cfg) for every configuration (a failing one is logged and skipped), log them under
    log_key; returns (best cfg, its time in us, check(its output) or None). valid(check value): whether
    a configuration may be the best (a wrong but fast variant is logged, never picked)."""
    times = {}
    for i, cfg in enumerate(cfgs):
        try:
            # each configuration's first call in an NVTX range of its own, for Nsight to pick one:
            # NCU_EXTRA="--nvtx --nvtx-include attn_cfgs_5/" (log_key, then its place in cfgs)
            with torch.cuda.nvtx.range(f"{log_key}_{i}") if torch.cuda.is_available() else contextlib.nullcontext():
                out = run(**cfg)
            times[str(cfg)] = (bench(lambda: run(**cfg), **bench_kw), check(out) if check else None)
            # printed as it goes: a run cut off by its time limit still tells which configs were timed
            print(f"[sweep] {what} {cfg}: {times[str(cfg)][0]:.1f} us"
                  + (f" (check {times[str(cfg)][1]})" if check else ""), flush=True)
        except Exception as ex:  # noqa: BLE001
            LOG["errors"].append(f"{what} cfg {cfg}: {ex!r}"[:400])
            print(f"[sweep] {what} {cfg}: failed {ex!r}"[:300], flush=True)
    LOG[log_key] = times if check else {c: t for c, (t, _) in times.items()}
    if not times:
        raise RuntimeError(f"no {what} configuration ran (see the errors above)")
    ok = [c for c in times if valid is None or valid(times[c][1])]
    if not ok:
        raise RuntimeError(f"no {what} configuration passed its check: {times}")
    best = min(ok, key=lambda c: times[c][0])
    return next(c for c in cfgs if str(c) == best), *times[best]


def kernel_breakdown(fn, iters=20):
    """Device time per kernel name of one call of fn (mean over iters calls, torch.profiler), in us:
    which launch of a multi-kernel entry point holds the time."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if "CUDA" not in str(getattr(e, "device_type", "CUDA")):  # the kernels, not the aten ops around them
            continue
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if t > 0:
            out[e.key[:60]] = round(t / iters, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def row(name, us, floor_us, limit, extra, eager_us, check, goal_us):
    LOG["rows"].append(dict(name=name, us=us, floor_us=floor_us, limit=limit, extra=extra, eager_us=eager_us,
                            check=check, goal_us=goal_us))
    print(f"[row] {name}: {us:.1f} us (floor {floor_us:.1f}, goal {goal_us}), eager {eager_us}, {check}", flush=True)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / a.norm()).item()
