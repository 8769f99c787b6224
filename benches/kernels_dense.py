"""The dense cases of benches/kernels.py: the FP8 block-scaled linear (prefill and decode-step shapes),
the quantizers, RMSNorm, the Engram's gated update and the float32 GEMM on tensor cores."""

from __future__ import annotations

import torch

from engine import quant as Q
from kernels import engram, f32_gemm, fp8_linear, quant, rmsnorm, router

from benches.kernel_bench import DEV, LOG, bench, rel, row, sweep


def case_linear(bw, mm):
    """The prefill product, then the release layer's decode-step shapes (64 rows), each swept against
    the old launch (prefill: the FP8 form's default, 1,597 us at 4096 x 5120 x 8192; decode: one split,
    64 x 128 tiles of 8 warps: 131.8 us at 64 x 5120 x 8192, run 1), the bf16 form among the candidates."""
    old = dict(split_k=1, block_n=128, num_warps=8)
    decode_cfgs = [dict(), old, dict(split_k=1), dict(waves=1), dict(waves=4), dict(num_stages=3),
                   dict(num_stages=6), dict(block_n=64),  # 64 x 64 tiles: the first split-K default
                   dict(mma="bf16"), dict(mma="bf16", block_k=128), dict(mma="bf16", waves=4)]
    bf16 = dict(mma="bf16")
    prefill_cfgs = [dict(), bf16, dict(bf16, num_stages=3),  # the FP8 form; bf16 128 x 256 x 64, 8 warps
                    dict(bf16, block_n=128), dict(bf16, block_n=128, block_k=128, num_stages=3),
                    dict(bf16, block_m=256, block_n=128, num_stages=3), dict(bf16, block_m=64),
                    dict(mma="cublas")]  # the weight's bf16 values made for the call, cuBLAS (TritonOps.linear_cublas)
    # the layer's other prefill products: the bf16 form (its default since run 18) against the cuBLAS form
    other_prefill = [bf16, dict(mma="cublas")]
    for m_, n_, k_, what in ((4096, 5120, 8192, "wo_b"), (4096, 32768, 1280, "wq_b"), (4096, 1280, 5120, "wq_a"),
                             (4096, 2304, 5120, "shared expert w1"), (4096, 512, 5120, "wkv"),
                             (64, 5120, 8192, "wo_b"), (64, 32768, 1280, "wq_b"),
                             (64, 1280, 5120, "wq_a"), (64, 2304, 5120, "shared expert w1")):
        x = torch.randn(m_, k_, device=DEV).bfloat16()
        w = (torch.randn(n_, k_, device=DEV) * 30).to(torch.float8_e4m3fn)
        ws = torch.randint(118, 124, (n_ // 32, k_ // 32), dtype=torch.uint8, device=DEV).view(torch.float8_e8m0fnu)

        def eager():
            q, s = quant.quantize_fp8_triton(x)  # same activations for both
            a = (q.float().unflatten(-1, (-1, 32)) * s.float().unsqueeze(-1)).flatten(-2)
            b = w.float() * ws.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
            return (a @ b.T).bfloat16()
        want = eager()
        small = m_ <= 64
        cfg, t, r = sweep(f"linear_cfgs_{m_}x{n_}x{k_}", f"linear {m_}x{n_}x{k_}",
                          decode_cfgs if small else prefill_cfgs if what == "wo_b" else other_prefill,
                          lambda **c: fp8_linear.fp8_linear_triton(x, w, ws, **c), lambda out: rel(want, out),
                          valid=lambda r: r < 1e-2, graph=small, rep=100)
        if small:
            LOG[f"linear_plan_{m_}x{n_}x{k_}"] = fp8_linear.fp8_linear_plan(m_, n_, k_, x.device)
        te = bench(eager, rep=100, graph=small)
        flops = 2.0 * m_ * n_ * k_
        byt = n_ * k_ + m_ * k_ * 2 + m_ * n_ * 2
        floor = max(flops / mm, byt / bw) * 1e6
        row(f"FP8 block-scaled linear {m_}x{n_}x{k_} ({what})", t, floor, "HBM" if small else "bf16 MMA",
            f"{flops / t / 1e6:.0f} TFLOP/s, {byt / t / 1e6:.2f} TB/s; cfg {cfg}", te, f"rel {r:.1e}", "-")


def case_quant(bw, mm):
    ok = []
    for shape, block, kind in (((4096, 512), 16, "e4m3"), ((4096, 128), 32, "e8m0")):
        x = (torch.randn(shape, device=DEV) * torch.logspace(-4, 2, shape[0], device=DEV)[:, None]).bfloat16()
        a = Q.quantize_fp4(x.cpu(), block, kind)
        b = quant.quantize_fp4_triton(x, block, kind)
        ok.append(torch.equal(a[0], b[0].cpu()) and torch.equal(a[1].view(torch.uint8), b[1].cpu().view(torch.uint8)))
    x = (torch.randn(4096, 512, device=DEV) * 3).bfloat16()
    a = Q.quantize_fp8(x.cpu())
    b = quant.quantize_fp8_triton(x)
    ok.append(torch.equal(a[0].view(torch.uint8), b[0].cpu().view(torch.uint8))
              and torch.equal(a[1].view(torch.uint8), b[1].cpu().view(torch.uint8)))
    # time the KV-entry quantizer at 64K entries
    x = torch.randn(65536, 512, device=DEV).bfloat16()
    t = bench(lambda: quant.quantize_fp4_triton(x, 16, "e4m3"), rep=100)

    def eager():
        g = x.float().unflatten(-1, (-1, 16))
        s = (g.abs().amax(-1).clamp_min(6 * 2**-9) / 6).clamp(max=448).to(torch.float8_e4m3fn)
        v = (g / s.float().unsqueeze(-1)).clamp(-6, 6)
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=DEV)
        code = (v.abs().unsqueeze(-1) > mids).sum(-1).to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
        code = code.flatten(-2)
        return code[..., 0::2] | (code[..., 1::2] << 4), s
    te = bench(eager, rep=100)
    byt = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    row("FP4 KV-entry quantizer, 64K x 512 (E4M3/16)", t, byt / bw * 1e6, "HBM", f"{byt / t / 1e6:.2f} TB/s", te,
        f"bit-exact vs engine.quant (kv/index/window): {ok}", "-")


def case_norm(bw, mm):
    """RMSNorm 4096 x 5120 (PERFORMANCE.md's row): bf16 in, bf16 out (the row's goal and floor assume 2 bytes
    a value each way), then float32 in, bf16-rounded float32 out, as the kernel path runs it today; eager =
    engine.ops' rms_norm and the reference's rounding (its seven launches). Each row's check also gives a
    plain device copy of the same bytes (input into an output-sized tensor), timed alike: what this
    machine's copy reaches at this size, against the goal. Then the picked and the listed configurations
    again writing a preallocated output (`out=`, one buffer each, as the copy writes a fixed one), printed
    beside their allocating times and the copy's (run 20b-20d: the kernel's times bimodal, the copy's not)."""
    x, w = torch.randn(4096, 5120, device=DEV), torch.randn(5120, device=DEV)
    want = rmsnorm.rms_norm_reference(x, w, 1e-6, round_bf16=True)
    # run 18a: one row a program 30.2 us (bf16) / 46.8 (float32), 2 rows 29.6 / 46.8, 4 rows 42.6 / 53.0
    cfgs = [{}, dict(rows_per_program=2), dict(programs_per_sm=4), dict(programs_per_sm=8),
            dict(programs_per_sm=4, num_warps=16), dict(programs_per_sm=2, num_warps=16)]
    # the row in chunks (5120 = 5 x 1024; 2048 leaves a masked half chunk), eviction hints
    chunked = [dict(chunk=512, num_warps=4), dict(chunk=1024, num_warps=4), dict(chunk=1024, num_warps=8),
               dict(chunk=2048, num_warps=4), dict(chunk=2048, num_warps=8), dict(chunk=1024, num_warps=4, hints=True),
               dict(chunk=1024, num_warps=4, programs_per_sm=8), dict(chunk=2048, num_warps=8, programs_per_sm=4),
               dict(programs_per_sm=2, num_warps=16, hints=True)]
    # preallocated output (the sweep's pick added): run 20b-20d's best, and the default
    prealloc = {"bf16 in, bf16 out": [{}, dict(chunk=1024, num_warps=4), dict(chunk=2048, num_warps=4)],
                "float32, bf16-rounded out": [{}]}
    for name, xin, out_dtype, goal, tried in (("bf16 in, bf16 out", x.bfloat16(), torch.bfloat16, 23, cfgs + chunked),
                                              ("float32, bf16-rounded out", x, torch.float32, "-", cfgs)):
        ref = rmsnorm.rms_norm_reference(xin, w, 1e-6, round_bf16=True) if xin is not x else want
        run = lambda **c: rmsnorm.rms_norm_triton(xin, w, 1e-6, round_bf16=True, out_dtype=out_dtype, **c)  # noqa: E731
        cfg, t, same = sweep(f"norm_cfgs_{name}", f"rmsnorm {name}", tried, run,
                             lambda out: (out.float() == ref).float().mean().item(), valid=lambda f: f > 0.999, rep=100)
        got = run()
        copy = torch.empty_like(got)
        tc = bench(lambda: copy.copy_(xin), rep=100)  # the same bytes read and written, no arithmetic
        te = bench(lambda: rmsnorm.rms_norm_reference(xin, w, 1e-6, round_bf16=True), rep=100)
        byt = x.numel() * (xin.element_size() + got.element_size())  # one read, one write
        row(f"RMSNorm 4096 x 5120 ({name})", t, byt / bw * 1e6, "HBM", f"{byt / t / 1e6:.2f} TB/s; cfg {cfg}", te,
            f"equal to the reference's rounding: {same:.6f} of values; same-bytes copy {tc:.1f} us", goal)
        LOG[f"norm_copy_us_{name}"] = tc
        try:  # after the row: a failure here costs only these timings
            _norm_preallocated(name, run, ref, got, tc, [cfg] + [c for c in prealloc[name] if c != cfg])
        except Exception as ex:  # noqa: BLE001
            LOG["errors"].append(f"rmsnorm {name} preallocated: {ex!r}"[:400])
            print(f"[norm] {name} preallocated: failed {ex!r}"[:300], flush=True)


def _norm_preallocated(name, run, ref, like, tc, cfgs):
    """run(**cfg, out=buffer) for each cfg, a NaN-filled buffer each made once here (outside the timing, so
    an element left unwritten fails the check; the check also wants the buffer returned), checked against
    ref as the allocating sweep checks. Logs norm_prealloc_cfgs_<name> (as sweep) and
    norm_alloc_vs_prealloc_<name>: cfg -> the allocating sweep's time, the allocating call timed again
    right after, the preallocated time, the copy's, and both outputs' addresses; prints them side by side."""
    bufs = {str(c): torch.full_like(like, float("nan")) for c in cfgs}
    pre = lambda **c: run(out=bufs[str(c)], **c)  # noqa: E731
    sweep(f"norm_prealloc_cfgs_{name}", f"rmsnorm {name} preallocated", cfgs, pre,
          lambda out: (out.float() == ref).float().mean().item() * any(out is b for b in bufs.values()),
          valid=lambda f: f > 0.999, rep=100)
    alloc, prealloc = LOG[f"norm_cfgs_{name}"], LOG[f"norm_prealloc_cfgs_{name}"]
    us = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    side = {}
    for cfg in cfgs:
        c = str(cfg)
        again = bench(lambda: run(**cfg), rep=100)  # beside the preallocated timing, not minutes before it
        side[c] = dict(alloc_us=alloc.get(c, (None,))[0], alloc_again_us=again,
                       prealloc_us=prealloc.get(c, (None,))[0], copy_us=tc,
                       prealloc_equal=prealloc.get(c, (None, None))[1],
                       alloc_ptr=hex(run(**cfg).data_ptr()), prealloc_ptr=hex(bufs[c].data_ptr()))
        print(f"[norm] {name} {c}: allocating {us(side[c]['alloc_us'])} us (again {again:.1f}), preallocated "
              f"{us(side[c]['prealloc_us'])} us, same-bytes copy {tc:.1f} us", flush=True)
    LOG[f"norm_alloc_vs_prealloc_{name}"] = side


def case_engram(bw, mm):
    """The Engram's gated update at a 4,096-token prefill (4 copies of 5120; kv [T, 5 x 5120]), float32 stream
    in, bf16-rounded float32 out, as the kernel path runs it; eager = the engine's torch op and the reference's
    rounding (~20 launches; ~3 ms of run 18c's SWA + Engram prefill). Floor: one read of x and kv, one write."""
    t_, hc, d = 4096, 4, 5120
    x = torch.randn(t_, hc, d, device=DEV).bfloat16().float()
    kv = torch.randn(t_, (hc + 1) * d, device=DEV).bfloat16().float()
    qw, kw = torch.rand(hc, d, device=DEV) + 0.5, torch.randn(hc, d, device=DEV)
    mask = torch.rand(t_, device=DEV) > 0.01
    want = engram.engram_mix_reference(x, kv, qw, kw, 1e-6, mask, round_bf16=True)
    run = lambda **c: engram.engram_mix_triton(x, kv, qw, kw, 1e-6, mask, round_bf16=True, **c)  # noqa: E731
    cfg, t, same = sweep("engram_cfgs", "engram mix", [{}, dict(num_warps=4), dict(num_warps=16)], run,
                         lambda out: (out == want).float().mean().item(), valid=lambda f: f > 0.99, rep=50)
    te = bench(lambda: engram.engram_mix_reference(x, kv, qw, kw, 1e-6, mask, round_bf16=True), rep=20)
    byt = (x.numel() * 2 + kv.numel()) * 4
    row("Engram mix 4096 x 4 x 5120 (float32 stream, bf16-rounded out)", t, byt / bw * 1e6, "HBM",
        f"{byt / t / 1e6:.2f} TB/s; cfg {cfg}", te, f"equal to the reference's rounding: {same:.6f} of values", "-")


def case_f32(bw, mm):
    """The prefill's float32 GEMMs (the router's gate 4096 x 384 x 5120; a compressor's projection 4096 x 1024 x
    5120) on tensor cores at float32 accuracy (kernels/f32_gemm.py, TritonOps knob f32_tf32x3), against cuBLAS's
    float32 GEMM in the same run (the engine's form: CUDA-core sgemm, 0.33 ms for the gate in run 18c); then the
    bf16 pass on operands holding bf16 values (the engine's under `reference`, knob f32_one_pass), its steps
    promoted to float32 or not, tf32x3 beside it on the same operands."""
    cfgs = [{}, dict(block_m=128, block_n=128, num_warps=8), dict(block_k=16), dict(block_k=64, num_stages=2),
            dict(block_m=64, block_n=64), dict(num_stages=4)]
    cfgs_bf16 = [{}, dict(block_m=128, block_n=128, num_warps=8), dict(block_m=128, block_n=64, num_warps=4),
                 dict(block_n=64), dict(block_k=128, num_stages=2), dict(num_stages=4), dict(block_n=256, num_warps=8),
                 dict(block_k=32, num_stages=4)]
    for m_, n_, k_, what in ((4096, 384, 5120, "router gate"), (4096, 1024, 5120, "compressor")):
        x, w = torch.randn(m_, k_, device=DEV), torch.randn(n_, k_, device=DEV) / k_ ** 0.5
        want = (x.double() @ w.double().t()).float()
        cfg, t, r = sweep(f"f32_gemm_cfgs_{m_}x{n_}x{k_}", f"f32 gemm {what}", cfgs,
                          lambda **c: f32_gemm.f32_gemm_triton(x, w, **c), lambda out: rel(want, out),
                          valid=lambda r: r < 1e-5, rep=50)
        te = bench(lambda: x @ w.t(), rep=50)
        flops = 2.0 * m_ * n_ * k_
        row(f"float32 GEMM {m_}x{n_}x{k_} ({what}, tf32x3)", t, flops / mm * 1e6, "bf16 MMA",
            f"{flops / t / 1e6:.0f} TFLOP/s; cfg {cfg}; cuBLAS float32 {te:.1f} us, rel {rel(want, x @ w.t()):.1e}",
            te, f"rel {r:.1e}", "-")
        # the engine's operands under `reference` (knob f32_one_pass): x float32 of bf16 values, the weight's bf16
        # copy; the bf16 pass with each step promoted to float32 (the engine's) and in the MMA's own sums, against
        # tf32x3 on the same operands
        x16, w16 = x.bfloat16().float(), w.bfloat16()
        want16, w16f = (x16.double() @ w16.double().t()).float(), w16.float()
        three = f32_gemm.f32_gemm_triton(x16, w16f)
        t3 = bench(lambda: f32_gemm.f32_gemm_triton(x16, w16f), rep=50)
        for promote in (True, False):
            cfg, t, r = sweep(f"f32_gemm_bf16_promote{int(promote)}_cfgs_{m_}x{n_}x{k_}",
                              f"f32 gemm bf16 promote={promote} {what}", cfgs_bf16,
                              lambda **c: f32_gemm.f32_gemm_triton(x16, w16, precision="bf16", promote=promote, **c),
                              lambda out: rel(want16, out), valid=lambda r: r < 1e-5, rep=50)
            one = f32_gemm.f32_gemm_triton(x16, w16, precision="bf16", promote=promote, **cfg)
            how = "each step promoted to float32" if promote else "the MMA's own sums"
            row(f"float32 GEMM {m_}x{n_}x{k_} ({what}, bf16-valued operands, one bf16 pass, {how})", t,
                flops / mm * 1e6, "bf16 MMA", f"{flops / t / 1e6:.0f} TFLOP/s; cfg {cfg}; tf32x3 on the same operands "
                f"{t3:.1f} us, rel {rel(want16, three):.1e}; max |bf16 pass - tf32x3| {(one - three).abs().max():.1e}",
                t3, f"rel {r:.1e}", "-")


def case_router(bw, mm):
    """The router's top-6 of 384 biased scores (kernels/router.py, TritonOps knob router_topk) at a 4K prefill's and
    a 64-token decode step's rows, against torch.topk (the engine's form: one sbtopk launch, 81 us at 4K tokens in
    H100 run 31f's layer profile) in the same run; the picks must be torch's (random rows: no ties)."""
    for t in (4096, 64):
        biased = torch.randn(t, 384, device=DEV)
        want = biased.topk(6, dim=-1).indices
        cfg, us, same = sweep(f"route_topk_cfgs_{t}", f"router top-6 {t}", [{}, dict(block_t=8), dict(block_t=32),
                                                                        dict(block_t=16, num_warps=8)],
                              lambda **c: router.route_topk_triton(biased, 6, **c),
                              lambda out: bool(torch.equal(out, want)), valid=bool)
        te = bench(lambda: biased.topk(6, dim=-1).indices)
        byt = biased.numel() * 4 + t * 6 * 8
        row(f"router top-6 of 384, {t} tokens", us, byt / bw * 1e6, "HBM", f"cfg {cfg}; torch.topk {te:.1f} us",
            te, f"picks equal to torch.topk: {same}", "-")
