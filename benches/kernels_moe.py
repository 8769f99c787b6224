"""The FP4 MoE cases of benches/kernels.py (decode 1 token, the 64-token decode step, prefill 4K; both
forms), at the release's expert shapes."""

from __future__ import annotations

import time

import torch

from engine import quant as Q
from kernels import fp4_tiles, moe, moe_ws

from benches.kernel_bench import DEV, LOG, bench, fp4_dev, kernel_breakdown, rand_fp4, rel, row, sweep


E, INTER, DIM, K = 384, 2304, 5120, 6


def _release_experts():
    """Random FP4 experts at the release's shapes (w1, s1, w3, s3, w2, s2), small scales: outputs O(1)."""
    w1, s1 = rand_fp4((E, INTER, DIM), 32)
    w3, s3 = rand_fp4((E, INTER, DIM), 32)
    w2, s2 = rand_fp4((E, DIM, INTER), 32)
    return tuple(v if i % 2 == 0 else (v.view(torch.uint8) - 6).view(torch.float8_e8m0fnu)
                 for i, v in enumerate((w1, s1, w3, s3, w2, s2)))


def _engine_prefill_forms(history: bool = True):
    """The engine's prefill forms (hidden="reference": w * h rounded as the reference rounds it, E4M3 per 32),
    TritonOps' Triton form first (its default where no Gluon form runs; on a Hopper GPU the register-operand form
    since run 38a, which case_moe_prefill adds); history: the forms it was picked from too. The halves form (run
    35a: the decoded weights in shared memory, 16.2-28.5 ms against the default's 8.4) is gone: notes/kernels.md."""
    engine_form = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, hidden="reference")
    narrow = dict(engine_form, bf16_decode="fold", block_n=64, maxnreg=168, down_block_n=64, down_maxnreg=0)
    default = dict(narrow, split_m=128, split_n=64, split_maxnreg=0)  # moe_split_tiles beside the narrow tiles
    return [default] + ([engine_form, dict(engine_form, bf16_decode="fold"), dict(engine_form, block_n=64),
                         dict(engine_form, bf16_decode="fold", split_m=128),
                         # TritonOps.moe_narrow_down / moe_narrow_gate_up: more programs an SM (sm_90: down 2 -> 4,
                         # gate/up 2 -> 3)
                         dict(engine_form, bf16_decode="fold", down_block_n=64),
                         dict(engine_form, bf16_decode="fold", block_n=64, maxnreg=168, down_block_n=128,
                              down_maxnreg=0), narrow] if history else [])


def case_moe_prefill(bw, mm, forms=None):
    """The engine's 4K prefill forms alone (`--only moe_prefill`; forms: the default and candidates beside it), each
    against the default's output (the same numerics: a distance in the order of sums and an occasional rounding step
    of the hidden state)."""
    W = _release_experts()
    x = torch.randn(4096, DIM, device=DEV).bfloat16()
    ids = torch.stack([torch.randperm(E, device=DEV)[:K] for _ in range(4096)]).int()
    tw = torch.softmax(torch.randn(4096, K, device=DEV), -1) * 1.5
    forms = forms or _engine_prefill_forms(history=False)
    if moe_ws.runs_on(DEV):  # the Gluon forms beside it: register operands (the engine's default here), then
        # warp-specialized
        rs = dict(forms[0], ws="rs")
        # the register-operand form: 4 / 3 stages; two 128-wide stages (a copy and a wait for two K steps); 64-token
        # tiles alone (no 128-token split tiles); 8 token blocks a group. Run 38a: 5,912 / 6,075 / 6,053 / 6,796 us,
        # 6 stages 7,105, the warp-specialized form (ws=True, two decoders, a program a tile or persistent)
        # 9,038-10,345: those two dropped here
        # token blocks of 64 / 80 / 96 / 128 pairs (moe_align_classes; knob moe_tile_classes; run 40a: 5,646.5 us
        # against the split tiles' 5,959.1), then with x ordered by its round trip (knob moe_rs_round_trip)
        sized = dict(rs, split_m=(80, 96, 128))
        # dropped after run 44a (H100, us; the default 5,616.3): the copies issued by a producer warp (two
        # warpgroups at 128 registers, 2 programs an SM where the plain form has 3) 5,865.3 with blocks to 96 pairs,
        # 6,075.8 to 128, 5,664.4 with 128-wide stages at 3 stages; 128-wide stages at 3 stages 5,646.8, at 2 5,907.4.
        # Dropped after runs 38a/40a: 3 stages, 64-token tiles alone, 8 blocks a group
        forms = forms + [rs, sized, dict(sized, rs_round_trip=True)]
    base = moe.moe_fp4_triton(x, *W, ids, tw, **forms[0])
    best, t, r = sweep("moe_cfgs_engine_hidden", "moe prefill, engine's hidden", forms,
                       lambda **c: moe.moe_fp4_triton(x, *W, ids, tw, **c), lambda out: rel(base, out),
                       valid=lambda r: r < 1e-2, rep=50)
    flops = 2.0 * 4096 * K * 3 * INTER * DIM
    row("FP4 MoE prefill, 4K tokens, the engine's forms", t, flops / mm * 1e6, "bf16 MMA",
        f"{flops / t / 1e6:.0f} TFLOP/s; cfg {best}", None, f"rel {r:.1e} to the default form", 3200)
    if moe_ws.runs_on(DEV):
        _padding_probe(x, W, ids, tw, dict(forms[0], ws="rs"), flops, mm)


def _padding_probe(x, W, ids, tw, form, flops, mm):
    """Where the register-operand form's time goes: its launches (gate/up and down, 64- and 128-token tiles), and
    the same pairs routed evenly (every expert exactly 64 pairs: no tile half empty) against the random routing's
    (~Poisson(64) pairs an expert: about half the experts fill a 128-token tile to ~56%)."""
    perm = torch.randperm(E, device=DEV)
    even = perm[(torch.arange(4096 * K, device=DEV) % E).view(4096, K)].int()  # 6 consecutive experts a token
    counts = torch.bincount(ids.long().flatten(), minlength=E)
    rows = int((torch.where(counts <= 64, 64, (counts + 127) // 128 * 128)).sum())
    for name, route in (("random", ids), ("even", even)):
        LOG[f"moe_prefill_rs_kernels_{name}"] = kb = kernel_breakdown(lambda: moe.moe_fp4_triton(x, *W, route, tw,
                                                                                                   **form))
        print(f"[kernels] moe prefill rs, {name} routing: {kb}", flush=True)
    t_even = bench(lambda: moe.moe_fp4_triton(x, *W, even, tw, **form), rep=50)
    row("FP4 MoE prefill, 4K tokens, every expert 64 pairs (register-operand form)", t_even, flops / mm * 1e6,
        "bf16 MMA", f"{flops / t_even / 1e6:.0f} TFLOP/s; the random routing's tiles hold {rows} token rows for "
        f"{4096 * K} pairs", None, "timing only", 3200)


def _prefill_4k(W, eager, bw, mm):
    """4K tokens, uniform routing: the tile decode's exactness, the bf16 form's sweep, the engine's forms."""
    e, inter, dim, k = E, INTER, DIM, K
    tq = 4096
    x = torch.randn(tq, dim, device=DEV).bfloat16()
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(tq)]).int()
    tw = torch.softmax(torch.randn(tq, k, device=DEV), -1) * 1.5
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    want = eager(x, ids, tw)
    torch.cuda.synchronize()
    te = (time.perf_counter() - t0) * 1e6
    # swap-AB tiles: block_n weight rows = wgmma M, block_m tokens = N (~64 tokens per expert here);
    # all compile for sm_90 on triton 3.6 and 3.7 without spills
    # the bf16 tile decode, checked bit for bit first (tests/test_kernels_moe.py's case; the interpreter
    # cannot run it): every FP4 byte under scale bytes 0..240, against engine.quant's decode
    pk = torch.arange(256, dtype=torch.int32, device=DEV).repeat(256, 1).to(torch.uint8).view(torch.int8)
    sb = (torch.arange(256, device=DEV) % 241).to(torch.uint8)[:, None].expand(256, 16).contiguous()
    sb = sb.view(torch.float8_e8m0fnu)
    tile = fp4_tiles.nib_order(Q.dequantize_fp4(pk, sb, 32))  # not `want`: the sweeps below check against it
    exact = {bd: torch.equal(fp4_tiles.fp4_tile_decoded(pk, sb, bd), tile.bfloat16().float() if bd else tile)
             for bd in (False, True)}
    fits = sb.view(torch.uint8)[:, 0] <= fp4_tiles.FOLD_MAX_SCALE_BYTE  # the folded form: NaN past its range
    folded = fp4_tiles.fp4_tile_decoded(pk, sb, "fold")
    exact["fold"] = torch.equal(folded[fits], tile[fits].bfloat16().float()) and bool(torch.isnan(folded[~fits]).all())
    LOG["moe_tile_decode_exact"] = {"float32 form": exact[False], "bf16 form": exact[True],
                                    "folded bf16 form": exact["fold"]}
    print(f"[moe] tile decode exact: {LOG['moe_tile_decode_exact']}", flush=True)
    # the default first (Nsight profiles a case's first launch); every 8-warp tile lost to the 4-warp
    # ones in runs 2-6; loading the next K step's weight words before this step's decode lost in runs
    # 7-11 (14.98 vs 12.99 ms) and is gone; bf16_decode (FP4 straight into bf16 bits) is the default since
    # run 11 (10.3 vs 10.6 ms); the wgmma A fragment's words loaded directly in the MMA's K order lost in
    # run 19a (18.5 ms, 24.0 at BK 128, 21.0 at 4 stages, vs 9.6) and is gone
    # the engine's form first (TritonOps.moe_fold: the scale folded into one bf16x2 multiply a pair, PTX; sm_90
    # SASS 621 vs 690 a K step; run 24a 9.66 vs 9.83 ms), so that Nsight's first launch is what the layer runs
    cfgs = [dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold"),
            dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
            dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, bf16_decode=False),
            dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3),
            dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4),
            dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
            dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold"),
            # experts past 64 pairs in 128-token x 64-row tiles, the others in the default's (TritonOps.moe_split_tiles)
            dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold", split_m=128),
            dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, bf16_decode="fold")]
    best, t, r = sweep("moe_cfgs", "moe", cfgs, lambda **c: moe.moe_fp4_triton(x, *W, ids, tw, **c),
                       lambda out: rel(want, out), valid=lambda r: r < 1e-2, rep=100)
    flops = 2.0 * tq * k * 3 * inter * dim
    row("FP4 MoE prefill, 4K tokens", t, flops / mm * 1e6, "bf16 MMA",
        f"{flops / t / 1e6:.0f} TFLOP/s; cfg {best}", te, f"rel {r:.1e} (eager timed once)", 3200)
    # the engine's forms, what the release layer runs (logged only: their own rounding of the hidden state, so
    # the distance to the bf16 form's eager output is not a verdict)
    try:
        sweep("moe_cfgs_engine_hidden", "moe prefill, engine's hidden", _engine_prefill_forms(),
              lambda **c: moe.moe_fp4_triton(x, *W, ids, tw, **c), lambda out: rel(want, out), rep=50)
    except Exception as ex:  # noqa: BLE001
        LOG["errors"].append(f"moe engine hidden: {ex!r}"[:400])


def case_moe(bw, mm, prefill: bool = True):
    """The experts' decode rows (1 token, the 64-token step, FP8 and hidden-state forms); prefill: the 4K rows too
    (`--only moe_decode` leaves them out)."""
    e, inter, dim, k = E, INTER, DIM, K
    W = _release_experts()
    w1, s1, w3, s3, w2, s2 = W

    def eager(x, ids, tw):
        out = torch.zeros(x.shape[0], dim, device=DEV)
        for ex in torch.unique(ids).tolist():
            tok, slot = (ids == ex).nonzero(as_tuple=True)
            a, b, c = fp4_dev(w1[ex], s1[ex], 32), fp4_dev(w3[ex], s3[ex], 32), fp4_dev(w2[ex], s2[ex], 32)
            xe = x[tok].float()
            hh = torch.nn.functional.silu((xe @ a.T).clamp(max=10)) * (xe @ b.T).clamp(-10, 10)
            out.index_add_(0, tok, (hh @ c.T) * tw[tok, slot][:, None])
        return out

    per_expert = 3 * inter * dim // 2 + 3 * inter * dim // 32
    # decode: 1 token
    x = torch.randn(1, dim, device=DEV).bfloat16()
    ids = torch.randperm(e, device=DEV)[:k][None].int()
    tw = torch.softmax(torch.randn(1, k, device=DEV), -1) * 1.5
    want = eager(x, ids, tw)
    # the GEMVs on mma.sync (each FP4 word decoded into its A fragment, the vector as the B operand; 3.5 SASS a weight
    # value against 6.5) were slower at every shape, H100 run 48a: 81.0-88.3 us against 68.9 (gate/up 43.2 against
    # 41.7, down 20.0 against 20.5, plus x's permuting copy, 5.1), the 64-token step at up to 8 pairs a program
    # 2,691-2,896 against 2,535, the hidden state 82.0 against 78.5: both forms sit at ~60% of the copy rate whatever
    # their instruction counts, so issue is not what bounds them (code: git show f860b6f:kernels/moe_mma_gemv.py)
    # GEMV split-K knobs (defaults first): runs 2-8 swept rows x words per step x unrolled steps and
    # gemv_prefetch (every prefetch shape 20-60% slower, runs 5, 7, 8; logs in benches/results); kept:
    # the default, the old 8-row gate/up and 32-row down blocks, and one larger shape
    # x in split order at 32-word steps (gemv_x_split, untimed): its vector loads 16-byte ones straight into the FMAs'
    # layout, 5 CTA barriers a program against 25 (the natural order's 8 loads each through shared memory), 1,320 SASS
    # a thread against 1,664, 69 registers against 80 (sm_90, triton 3.6); the natural order at 32-word steps beside
    # it (128 scalar loads of x a thread, no shared memory)
    dcfgs = [dict(), dict(gemv_block_n=8), dict(gemv_down_block_n=32),
             dict(gemv_block_n=32, gemv_block_kw=64, gemv_down_block_n=64, gemv_down_iters=3),
             dict(gemv_x_split=True, gemv_block_kw=32, gemv_iters=4), dict(gemv_block_kw=32, gemv_iters=4)]
    dbest, t, r = sweep("moe_decode_cfgs", "moe decode", dcfgs, lambda **c: moe.moe_fp4_triton(x, *W, ids, tw, **c),
                        lambda out: rel(want, out), valid=lambda v: v < 1e-3, graph=True)
    # which launch holds the time (memset, gate/up, down), default and best configuration
    for name, c in (("default", {}), ("best", dbest)):
        try:
            LOG[f"moe_decode_kernels_{name}"] = kb = kernel_breakdown(lambda: moe.moe_fp4_triton(x, *W, ids, tw, **c))
            print(f"[kernels] moe decode {name} {c}: {kb}", flush=True)
        except Exception as ex:  # noqa: BLE001
            LOG["errors"].append(f"moe decode breakdown: {ex!r}"[:300])
    te = bench(lambda: eager(x, ids, tw), rep=40)
    byt = k * per_expert
    row("FP4 MoE decode, 1 token, 6 of 384 experts", t, byt / bw * 1e6, "HBM",
        f"{byt / t / 1e6:.2f} TB/s; cfg {dbest}", te, f"rel {r:.1e}", 39)
    if prefill:
        _prefill_4k(W, eager, bw, mm)

    # the release layer's decode step: 64 sequences x top-6 (~230 of 384 experts, 1-2 tokens each), the
    # grouped GEMM at 16-token blocks; weight streaming, so the floor is the touched experts' bytes.
    # The profile of benches/release_layer.py put 4.2 of a decode step's 5.8 ms of kernels here.
    x = torch.randn(64, dim, device=DEV).bfloat16()
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(64)]).int()
    tw = torch.softmax(torch.randn(64, k, device=DEV), -1) * 1.5
    want = eager(x, ids, tw)
    touched = int(torch.unique(ids).numel())
    base = dict(block_m=16, block_n=64, num_warps=4)
    # runs 9-10: prefetch, BK 128/256, BN 128, 1 stage, scaled 4.65-10.4 ms (kernels-h200-run9.md, -run10.md);
    # runs 11-12 (one load per scale byte): BK 128/256, BN 128, fp32 decode all slower (2.92-3.76 ms)
    # run 19a: the wgmma A fragment's words loaded directly in the MMA's K order 6.8-8.2 ms vs 2.6 (gone)
    cfgs = [dict(), dict(base, maxnreg=64), dict(base, maxnreg=72), dict(base, num_stages=2),
            dict(base, num_stages=4), dict(base, block_n=128, num_warps=8), dict(base, block_k=128),
            dict(base, bf16_decode="fold"), dict(base, bf16_decode="fold", maxnreg=64)]  # fold: 336 vs 368 a K step
    best, t, r = sweep("moe_decode64_cfgs", "moe decode 64", cfgs, lambda **c: moe.moe_fp4_triton(x, *W, ids, tw, **c),
                       lambda out: rel(want, out), valid=lambda r: r < 1e-2, graph=True)
    # the scaled path against the bit-assembly path (both exact bf16 weights, fp32 sums: order only)
    LOG["moe_decode64_scaled_vs_default_rel"] = rel(moe.moe_fp4_triton(x, *W, ids, tw),
                                                    moe.moe_fp4_triton(x, *W, ids, tw, scaled=True))
    te = bench(lambda: eager(x, ids, tw), rep=20)
    byt = touched * per_expert
    row(f"FP4 MoE decode step, 64 tokens ({touched} experts)", t, byt / bw * 1e6, "HBM",
        f"{byt / t / 1e6:.2f} TB/s; cfg {best}", te, f"rel {r:.1e}", "-")
    # the FP8 tensor-core form (kernels/moe_f8.py): the reference's numerics (h quantized to E4M3 per 32,
    # bf16 roundings), so checked against its own float32 reference, not the bf16 form's eager
    want8 = moe.moe_fp4_reference(x, *W, ids, tw, fp8_mma=True)
    LOG["moe_decode64_f8_ref_vs_bf16_form_ref"] = rel(want8, want)
    f8 = dict(fp8_mma=True)
    # run 16b (scale bytes through tl.load, a shared-memory hop each): BN 64 3.20 ms, 128 2.55, BM 8 5.9
    cfgs = [dict(f8), dict(f8, num_warps=8), dict(f8, block_n=256, num_warps=8), dict(f8, block_n=64),
            dict(f8, block_m=8), dict(f8, num_stages=4), dict(hidden="reference")]  # the last: the bf16 form
    best, t, r = sweep("moe_decode64_f8_cfgs", "moe decode 64 fp8", cfgs,
                       lambda **c: moe.moe_fp4_triton(x, *W, ids, tw, **c),
                       lambda out: rel(want8, out), valid=lambda r: r < 1e-2, graph=True)
    row(f"FP4 MoE decode step on FP8 MMA, 64 tokens ({touched} experts)", t, byt / bw * 1e6, "HBM",
        f"{byt / t / 1e6:.2f} TB/s; cfg {best}", te, f"rel {r:.1e} (FP8 form's reference)", "-")
    hg = dict(hidden="reference", x_on_grid=True)  # x made on the E4M3 grid below; the engine's form (the
    # kernel's own round trip, from run 32 on) is the 1-token sweep's dict(hidden="reference")
    # x in split order (the sweep above): at four 32-word steps 176 registers here, at two 128 (the default's)
    xs, xs2 = (dict(gemv_x_split=True, gemv_block_kw=32, gemv_iters=n) for n in (4, 2))
    hidden_rows = [("1 token", 1, [dict(hg), dict(hidden="reference"), dict(hg, gemv_block_kw=64),
                                   dict(hg, gemv_down_block_n=32), dict(f8), dict(hg, **xs),
                                   dict(hidden="reference", **xs), dict(hidden="reference", **xs2)])]
    if prefill:
        hidden_rows.append(("prefill 4K", 4096, [dict(f8, block_m=64, block_n=128, num_warps=8),
                                                 dict(f8, block_m=32, block_n=128), dict(f8, block_m=64, block_n=64)]))
    for name, tq, cfgs in hidden_rows:
        x = Q.fp8_roundtrip(torch.randn(tq, dim, device=DEV), 32).bfloat16()
        ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(tq)]).int()
        tw = torch.softmax(torch.randn(tq, k, device=DEV), -1) * 1.5
        want8 = moe.moe_fp4_reference(x, *W, ids, tw, fp8_mma=True)
        run = lambda **c: moe.moe_fp4_triton(x, *W, ids, tw, **c)  # noqa: E731 (this iteration's x, ids, tw)
        best, t, r = sweep(f"moe_f8_{name}_cfgs", f"moe fp8 {name}", cfgs, run, lambda out: rel(want8, out),
                           valid=lambda r: r < 1e-2, graph=tq == 1)
        flops = 2.0 * tq * k * 3 * inter * dim
        floor, limit, goal = (k * per_expert / bw * 1e6, "HBM", 39) if tq == 1 else (flops / mm * 1e6, "bf16 MMA", 3200)
        row(f"FP4 MoE (hidden), {name}", t, floor, limit, f"cfg {best}", float("nan"), f"rel {r:.1e}", goal)
