"""Check and time every kernel at the release's shapes on one GPU; prints a markdown table last.

python benches/kernels.py [--out DIR]   (writes kernels-table.md and kernels-log.json into DIR)
Rows: median time, achieved rate, fraction of the ceiling measured in this run (HBM copy bandwidth,
bf16 matmul rate), speed-up over an eager PyTorch version in this run, and the parity check.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import quant as Q  # noqa: E402
from kernels import indexer, mhc, sparse_attn, topk  # noqa: E402

from benches.kernel_bench import DEV, LOG, bench, ceilings, fp4_dev, kernel_breakdown, rand_fp4, rel, row, sweep  # noqa: E402
from benches.kernels_dense import (case_engram, case_f32, case_linear, case_norm, case_quant,  # noqa: E402
                                   case_router)
from benches.kernels_moe import case_moe, case_moe_prefill  # noqa: E402

dec_scores = None


# -- cases ---------------------------------------------------------------------------------------

# the decode's forms, the default first: the keys decoded into the wgmma's registers (rs: kernels/indexer_rs.py, Gluon;
# ~95 registers, 355 SASS instructions a thread a 64-key tile where the Triton loop takes 448 for 128 at 8 warps; 1M
# keys with the top-512 54.5 us, H100 run 48a) over 2,048 group maxima (topk_split's SPLIT_PATH_DEFAULTS; 46a: 1,024
# 68.0 against 67.9 before half_cap; 45c: 4,096 78.9; 45b: 8,192 91.3; 48a: 1,024 61.6 against 63.8 before abs_scale)
# with the filter's slots a candidate at a time (46a: a tile's by a scan 71.6) and the resolve over half its buffer
# (46a: the whole 67.9; 48a: 68.2 against 63.8), with abs_scale (the keys' groups scaled absolutely: 314 instructions a
# tile, no key factor) and query_pairs (the query decoded by the keys' pair placement: 816 instructions a program's
# thread in all against 1,432), both default since 48a (54.5 against 63.8 without, 58.3 and 60.9 alone); then the Triton
# kernel (8 warps; 122 registers on sm_90: two programs an SM, four at 4 warps) and its launch shapes (46a: 128
# registers 110.1, 4 warps 88.2, no prefetch 108.9, 64-key tiles 132.6, 256 at 128 registers 85.8, at 112.1 by default).
# The rs programs' count (chunk, rounded up to a group of 512: 1,024 keys by default, 1,024 programs, ~1.55 waves at 5
# resident an SM) and a register cap timed in 46a, none faster: chunk 512 73.0, 2,048 69.5 (one wave at 4 an SM), 1,536
# 77.5 (45c), a cap of 80 (6 an SM, 24-32 B spilled) 69.7, with chunk 512 74.6
INDEXER_DECODE_CFGS = [{}, dict(abs_scale=False, query_pairs=False), dict(abs_scale=False), dict(query_pairs=False),
                       dict(groups=1024), dict(groups=4096), dict(select_tune=dict(atomic_slots=False)),
                       dict(select_tune=dict(half_cap=False)),
                       dict(rs=False), dict(rs=False, maxnreg=128), dict(rs=False, num_warps=4),
                       dict(rs=False, prefetch_keys=False), dict(rs=False, block_n=64),
                       dict(rs=False, block_n=256, maxnreg=128)]
# prefill 4K x 64K scoring, the default first (4 queries x 32 heads a tile, 4 warps; 8 queries at 8 warps:
# 7.71 against 7.87 ms; 2 queries 12.6, 128-key tiles at 8 warps 8.5). key_fold: the keys' group exponents
# in their E4M3 operands, one K = 128 dot a tile: 5.13 ms, 3.82-3.98 with more programs per SM, but the
# FP8 MMA's 13-bit chained accumulation leaves its rows 1.3e-4 off (the check rejects it: timed and
# logged, never picked). Not in the decode list: there its top-512 may match the fp32 eager one and win
# (131.8 us at 4 warps against 138.6) while 1.5e-4 off a float64 reference.
# the decode select on the scoring kernel's maxima (topk_split: 2,048 groups of 512, 256 filter programs, each finding
# the bound over all 2,048 maxima), the default first (5-bit histograms, the bound from 4 of 7 digits, 32 candidates a
# resolve program over its buffer's first half, a filter slot a candidate: 16.3 us on the H100 in run 46a), then
# around it (46a: the resolve over the whole buffer 18.7, the filter under a 128-register cap 18.5 there, the slots
# by a tile's scan 21.6, the bound from 3 digits 18.4 (a coarse bound kept off the default: topk_split), the
# counting search 31.0; the histogram searches skipping the digits their keys share 20.3, 17.0 with the half buffer:
# removed; 45c: a filter block of 8,192 21.3; 44d on 8,192 groups of 128: from 5 digits 39.3; 44b: 64 candidates a
# program 43.2, 8-bit digits from 2 of 4 44.4, 6-bit from 4 42.3; 44a: 8-bit digits 75.3, 4 warps 122.4)
INDEXER_DECODE_SELECT_CFGS = [{}, dict(half_cap=False), dict(filter_maxnreg=128), dict(atomic_slots=False),
                              dict(bound_steps=3), dict(select="count")]
INDEXER_PREFILL_CFGS = [{}, dict(block_t=8, num_warps=8), dict(key_fold=True), dict(key_fold=True, maxnreg=128),
                        dict(key_fold=True, block_t=8), dict(key_fold=True, block_t=8, num_warps=8, maxnreg=128)]


def case_indexer(bw, mm, prefill=True):
    """The decode (1 query over 1M entries, its select's forms) and, with prefill, the 4K x 64K logits and top-512."""
    h, d = 32, 128
    # decode: 1 query, 1M entries
    n = 1 << 20
    qp, qs = rand_fp4((1, h, d), 32)
    kp, ks = rand_fp4((n, d), 32)
    w = torch.randn(1, h, device=DEV) * (128 ** -0.5) * (32 ** -0.5)
    nv = torch.tensor([n], dtype=torch.int32, device=DEV)
    args = (qp, qs, kp, ks, w, nv)
    table = Q.FP4_TABLE.to(DEV)  # fp4_dev's setdefault copies its table from the host on every call

    def dec(packed, scale):  # fp4_dev without the per-call host copy, so the eager graph captures
        b = packed.view(torch.uint8)
        v = torch.stack([table[(b & 15).long()], table[(b >> 4).long()]], -1).flatten(-2)
        return (v.unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)).flatten(-2)

    def eager():
        q = dec(qp, qs)[0]
        k = dec(kp, ks)
        s = (torch.relu(q @ k.T) * w[0][:, None]).sum(0)
        return torch.sort(torch.topk(s, 512).indices).values.int()
    got = indexer.indexer_topk_triton(*args)
    want = eager()
    scores = indexer.indexer_scores_triton(*args)
    global dec_scores
    dec_scores = scores.clone()
    LOG["indexer_decode_scores_only_us"] = bench(lambda: indexer.indexer_scores_triton(*args), graph=True)
    LOG["indexer_decode_scores_only_triton_us"] = bench(lambda: indexer.indexer_scores_triton(*args, rs=False),
                                                        graph=True)
    # in float64: the check's figure read 2.4e-3 through run 45a and 1.3e-7 since against the float32 one (cause open)
    ref_s = (torch.relu(dec(qp, qs)[0].double() @ dec(kp, ks).double().T) * w[0][:, None].double()).sum(0)
    # the top-k stages alone on the scoring kernel's maxima (counts re-zeroed inside the timing)
    _, mx, cnt = indexer._launch(*args, None, 8, topk=512)
    LOG["indexer_decode_select_only_us"] = bench(
        lambda: (cnt.zero_(), topk.select_from_maxima(scores, 512, nv, mx, cnt)), graph=True)
    want_sel = topk.topk_positions_reference(scores, 512, nv)
    sweep("indexer_decode_select_cfgs", "indexer decode select", INDEXER_DECODE_SELECT_CFGS,
          lambda **c: (cnt.zero_(), topk.select_from_maxima(scores, 512, nv, mx, cnt, **c))[1],
          lambda out: torch.equal(out, want_sel), valid=bool, graph=True)
    print(f"[kernels] indexer decode: {kernel_breakdown(lambda: indexer.indexer_topk_triton(*args))}", flush=True)
    # launch shapes of the decode scoring (the default first): register caps (168 registers held it to 3
    # blocks of 4 warps per SM, ncu run 6), warps, programs (chunk: keys per program), key tile
    cfg, t, same = sweep("indexer_decode_cfgs", "indexer decode", INDEXER_DECODE_CFGS,
                         lambda **c: indexer.indexer_topk_triton(*args, **c),
                         lambda out: torch.equal(out[0], want), valid=bool, graph=True)
    chk = f"scores rel {rel(ref_s, scores[0]):.1e}; top-512 identical {same}; cfg {cfg}"
    te = bench(eager, graph=True, rep=40)
    floor = n * 68 / bw * 1e6
    row("indexer + top-512, decode, 1M entries", t, floor, "HBM", f"{n * 68 / t / 1e6:.2f} TB/s", te, chk, 28)
    del kp, ks, scores
    if not prefill:
        return

    # prefill: 4K queries x 64K entries (all visible)
    tq, n = 4096, 65536
    qp, qs = rand_fp4((tq, h, d), 32)
    kp, ks = rand_fp4((n, d), 32)
    w = torch.randn(tq, h, device=DEV) * (128 ** -0.5) * (32 ** -0.5)
    nv = torch.full((tq,), n, dtype=torch.int32, device=DEV)
    args = (qp, qs, kp, ks, w, nv)
    s = indexer.indexer_scores_triton(*args)
    qf, kf = fp4_dev(qp[:64], qs[:64], 32), fp4_dev(kp, ks, 32)
    ref = torch.einsum("thn,th->tn", torch.relu(torch.einsum("thd,nd->thn", qf, kf)), w[:64])
    chk = f"rows 0-63 rel {rel(ref, s[:64]):.1e}"

    def eager_scores():
        out = torch.empty(tq, n, device=DEV)
        kb = fp4_dev(kp, ks, 32).bfloat16()
        for c in range(0, tq, 256):
            qb = fp4_dev(qp[c:c + 256], qs[c:c + 256], 32).bfloat16()
            sc = torch.relu(torch.einsum("thd,nd->thn", qb, kb).float())
            out[c:c + 256] = torch.einsum("thn,th->tn", sc, w[c:c + 256])
        return out
    flops = 2.0 * tq * h * d * n
    cfg, t, r = sweep("indexer_prefill_cfgs", "indexer prefill", INDEXER_PREFILL_CFGS,
                      lambda **c: indexer.indexer_scores_triton(*args, **c), lambda out: rel(ref, out[:64]),
                      valid=lambda r: r < 1e-5, rep=100)
    chk += f"; cfg {cfg} rel {r:.1e}"
    te = bench(eager_scores, rep=100)
    row("indexer logits, prefill 4K x 64K", t, flops / mm * 1e6, "bf16 MMA",
        f"{flops / t / 1e6:.0f} TFLOP/s", te, chk, 2500)
    del kf, ref
    # top-512 over those logits: the rows path (group maxima, ~1/8 of each row re-read, resolve on chip)
    want = torch.sort(torch.topk(s[:256], 512, dim=1).indices, dim=1).values.int()
    got = topk.topk_positions_triton(s, 512)
    t = bench(lambda: topk.topk_positions_triton(s, 512), rep=100)
    chk = f"rows 0-255 identical {torch.equal(got[:256], want)}"
    # the indexer's own prefill top-k: maxima written by the scoring kernel, so only the re-read
    sc, mx, cnt = indexer._launch(*args, None, 8, topk=512)
    got = topk.select_from_maxima(sc, 512, nv, mx, cnt)
    LOG["indexer_prefill_select_only_us"] = bench(lambda: topk.select_from_maxima(sc, 512, nv, mx, cnt), rep=100)
    # the rows path's tuned knobs (ROWS_PATH_DEFAULTS) on the indexer's maxima: capped, then also hist/2048
    for name, kw in (("capped", dict(maxnreg=64)), ("tuned", dict(maxnreg=64, select="hist", block=2048))):
        LOG[f"indexer_prefill_select_{name}_us"] = bench(
            lambda: topk.select_from_maxima(sc, 512, nv, mx, cnt, **kw), rep=100)
        LOG[f"indexer_prefill_select_{name}_identical_rows_0_255"] = torch.equal(
            topk.select_from_maxima(sc, 512, nv, mx, cnt, **kw)[:256], want)
    LOG["indexer_prefill_select_identical_rows_0_255"] = torch.equal(got[:256], want)
    del sc, mx
    LOG["topk_decode_1M_us"] = bench(lambda: topk.topk_positions_triton(dec_scores, 512), graph=True)
    LOG["topk_decode_1M_identical"] = torch.equal(
        topk.topk_positions_triton(dec_scores, 512)[0],
        torch.sort(torch.topk(dec_scores[0], 512).indices).values.int())
    te = bench(lambda: torch.sort(torch.topk(s, 512, dim=1).indices, dim=1).values, rep=100)
    byt = s.numel() * 4
    row("top-512 over 4K x 64K logits", t, byt / bw * 1e6, "HBM", f"{byt / t / 1e6:.2f} TB/s (1 read)", te, chk, 600)


# top-512 over 4K x 64K logits: the rows path's launch shapes and run 4's select="hist" (the bound and
# the threshold by 4 8-bit histogram steps instead of 16 counting steps of 3 reductions). Registers on
# sm_90 (triton 3.7): 16 warps 112 (1 block/SM), 8 warps 128-203 (2 blocks/SM at 128), 4 warps 204-255
# the default first (Nsight profiles a case's first launch; capped at 64 registers since run 7), the
# uncapped kernel (maxnreg 0: 126 registers held it to 2 rows of 8 warps per SM, ncu run 6), then around it
TOPK_CFGS = [{},
             # the group maxima's pass as a [groups, 16] tile (a group reduced in one warp's registers and shuffles;
             # the 1-D tile reshaped before run 42b went through shared memory, source-level Nsight 42a: 47% of the
             # stall samples in that pass at 2,048 entries a step, two barriers each) at its own width (run 42b, H100,
             # us: 2,048 763.0 -- the 1-D tile's 765.0 in 42a --, 4,096 708.3, 8,192 689.8, 16,384 683.3; 8,192 under 80
             # registers 621.5; 8,192 groups 1,901.0, block 4,096 985.4) and the register cap (run 42c: 16,384 under
             # 80 registers 608.6, the default since; 8,192 621.8; 16,384 under 96 689.6; 8,192 under 72 / 88 / 96
             # 664.5 / 737.5 / 731.4)
             dict(max_block=2048, maxnreg=64), dict(max_block=8192), dict(max_block=32768), dict(max_block=4096),
             # around the default (run 42a, H100, before the 2-D pass; us): uncapped 1,399.9, 56 registers 828.0, 48
             # 967.3, 16 warps 916.0, 4 warps 1,564.3, block 4,096 953.4, 1,024 groups 1,129.2, 8-bit digits
             # 1,274.8, 6-bit 868.4, bound_steps 3 / 4 782.9 / 772.9, 2,048 groups 795.4, no half tile 808.3 -- the
             # default 765.0
             dict(cap=1024), dict(bound_steps=4), dict(groups=2048), dict(num_warps=16, maxnreg=64)]
# a release prefill's own rows (the indexer's 4K queries, causal): the whole row one register tile, short rows on a
# tile half as wide (what the engine asks for, knob topk_whole_row: run 41e's 193.2 / 95.3 us against 385.6 / 250.8
# at run 40's defaults, the second config here)
TOPK_LAYER_CFGS = [{}, dict(hist_bits=8, groups=2048, bound_steps=0, half_tile=False), dict(whole_row=4096),
                   dict(whole_row=4096, whole_half=False), dict(whole_row=4096, whole_maxnreg=80),
                   dict(whole_row=4096, whole_warps=4), dict(whole_row=4096, whole_warps=16)]


def case_topk(bw, mm):
    """The top-512 row of case_indexer on the same kind of logits (the indexer's prefill scores),
    sweeping TOPK_CFGS; the row takes the fastest configuration whose rows 0-255 are identical to
    torch.topk's."""
    h, d, tq, n = 32, 128, 4096, 65536
    qp, qs = rand_fp4((tq, h, d), 32)
    kp, ks = rand_fp4((n, d), 32)
    w = torch.randn(tq, h, device=DEV) * (128 ** -0.5) * (32 ** -0.5)
    nv = torch.full((tq,), n, dtype=torch.int32, device=DEV)
    s = indexer.indexer_scores_triton(qp, qs, kp, ks, w, nv)
    del qp, qs, kp, ks
    want = torch.sort(torch.topk(s[:256], 512, dim=1).indices, dim=1).values.int()
    cfg, t, same = sweep("topk_cfgs", "topk", TOPK_CFGS, lambda **c: topk.topk_positions_triton(s, 512, **c),
                         lambda out: torch.equal(out[:256], want), valid=bool, rep=100)
    te = bench(lambda: torch.sort(torch.topk(s, 512, dim=1).indices, dim=1).values, rep=100)
    byt = s.numel() * 4
    row("top-512 over 4K x 64K logits (sweep)", t, byt / bw * 1e6, "HBM",
        f"{byt / t / 1e6:.2f} TB/s (1 read); cfg {cfg}", te, f"rows 0-255 identical {same}", 600)


def case_topk_layer(bw, mm):
    """The top-512 of a 4K prefill's indexer rows in the release layer (its row select, ~0.4 ms of the Full roles'
    H100 graphs, run 40b): 4,096 causal queries over 4,096 entries (m=1: query t sees t + 1) and over 2,048 (m=2:
    (t + 1) // 2), sweeping TOPK_LAYER_CFGS; every row checked against a stable sort's exact picks."""
    h, d, tq = 32, 128, 4096
    qp, qs = rand_fp4((tq, h, d), 32)
    w = torch.randn(tq, h, device=DEV) * (128 ** -0.5) * (32 ** -0.5)
    for ratio in (1, 2):
        n = tq // ratio
        kp, ks = rand_fp4((n, d), 32)
        nv = (torch.arange(tq, device=DEV, dtype=torch.int32) + 1) // ratio
        s = indexer.indexer_scores_triton(qp, qs, kp, ks, w, nv)
        v = s.masked_fill(torch.arange(n, device=DEV)[None, :] >= nv[:, None].long(), float("-inf"))
        want = topk.topk_positions_reference(s, 512, nv)
        cfg, t, same = sweep(f"topk_layer_cfgs_m{ratio}", f"topk layer m={ratio}", TOPK_LAYER_CFGS,
                             lambda **c: topk.topk_positions_triton(s, 512, nv, **c),
                             lambda out: torch.equal(out, want), valid=bool, rep=100)
        te = bench(lambda: torch.sort(torch.topk(v, 512, dim=1).indices, dim=1).values, rep=100)
        byt = s.numel() * 4
        row(f"top-512 of a 4K prefill's causal rows over {n} entries (sweep)", t, byt / 2 / bw * 1e6, "HBM",
            f"cfg {cfg}", te, f"every row identical {same}", "-")


def _attn_inputs(tq, n_pool, n_win):
    h, d = 64, 512
    q = torch.randn(tq, h, d, device=DEV).bfloat16()
    kvp, kvs = rand_fp4((n_pool, d), 16, "e4m3")
    w8 = (torch.randn(n_win, d, device=DEV) * 50).to(torch.float8_e4m3fn)
    ws = torch.randint(118, 122, (n_win, d // 32), dtype=torch.uint8, device=DEV).view(torch.float8_e8m0fnu)
    idx = torch.randint(0, n_pool, (tq, 512), dtype=torch.int32, device=DEV)
    idx[:, 500:] = -1
    widx = torch.randint(0, n_win, (tq, 128), dtype=torch.int32, device=DEV)
    sink = torch.randn(h, device=DEV)
    return q, kvp, kvs, idx, w8, ws, widx, sink


def attn_eager(q, kvp, kvs, idx, w8, ws, widx, sink):
    # FP4 decoded by arithmetic on the device, not with fp4_dev: its table comes from the host on every
    # call (setdefault evaluates the .to() each time), which a CUDA graph capture refuses
    b = kvp.view(torch.uint8)
    c = torch.stack([b & 15, b >> 4], -1).flatten(-2).to(torch.int32)  # [N, D] E2M1 codes
    ex, m = (c & 7) >> 1, (c & 1).float()
    v = torch.where(ex == 0, 0.5 * m, torch.exp2((ex - 1).float()) * (1 + 0.5 * m))
    kv = (torch.where(c >= 8, -v, v).unflatten(-1, (-1, 16)) * kvs.float().unsqueeze(-1)).flatten(-2)
    wv = (w8.float().unflatten(-1, (-1, 32)) * ws.float().unsqueeze(-1)).flatten(-2)
    e = torch.cat([kv[idx.clamp_min(0).long()], wv[widx.clamp_min(0).long()]], 1)  # [T, 640, D]
    valid = torch.cat([idx >= 0, widx >= 0], 1)
    s = torch.einsum("thd,tjd->thj", q.float(), e) * 512 ** -0.5
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink[None, :])
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink[None, :] - m)
    return (torch.einsum("thj,tjd->thd", p, e) / den[..., None]).bfloat16()


# the wrapper's default first (Nsight profiles a case's first launch): since run 35 the two passes' bf16x2 form
# with their own launch options (H100 35d at the 64 MB buffer: 2,257 us, 2,312 under the 128-register cap with 64
# output columns a pass-2 program, run 24a's pick at 16 MB: 2,693 us on the H200 then, plain bf16x2 2,796, the
# float32 two passes 4,078, "entries" 32 heads x 64 entries 4,394, "heads" 4,643). layout="entries": entries as the
# MMA's M, heads as N; BH 16 compiles without spills on triton 3.6 (4 programs per token, each decoding the tile),
# BH 32 spills ~116 B (2 programs per token)
# the two passes, then the engine's prefill form first among the Gluon ones (Nsight's launch): each selected tile's
# raw bytes copied (cp.async) into shared memory a tile ahead (since run 40) and the output stored in 16-byte pieces
# (per-line Nsight 42d; since run 44b; 44b: 1,369.5 us against 1,457.9 for the staged copies alone; 44a: 1,354.6
# against 1,480.0; the softmax's mask loaded before each tile's fill 1,595.6, both 1,500.4: that option removed).
# `--only attn_prefill` sweeps these alone
ATTN_PREFILL_CFGS = [dict(layout="two_pass", two_pass=dict(decode="bf16x2")),
                     dict(layout="wgmma", wgmma=dict(staged=True, wide_store=True)),
                     dict(layout="wgmma", wgmma=dict(staged=True)),
                     dict(layout="wgmma", wgmma=dict(staged=True, late_sum=True)),
                     dict(layout="wgmma", wgmma=dict(staged=True, wide_store=True, late_sum=True))]
ATTN_CFGS = [*ATTN_PREFILL_CFGS,
             # the one-pass Gluon form on wgmma (kernels/sparse_attn_wgmma.py; untimed before run 38), 64- and 32-entry
             # tiles
             dict(layout="wgmma"), dict(layout="wgmma", block_n=32),
             dict(layout="wgmma", block_n=32, wgmma=dict(ahead=True)), dict(layout="wgmma", wgmma=dict(late_sum=True)),
             dict(layout="entries", block_h=32, block_n=64, num_warps=8),
             dict(layout="two_pass", two_pass=dict(decode="bf16x2", maxnreg=128, block_v=64)),
             # candidates after run 24a: two tiles a scoring program; 128-entry tiles (the decode's winner)
             dict(layout="two_pass", two_pass=dict(decode="bf16x2", maxnreg=128, block_v=64, tiles_per_program=2)),
             dict(layout="two_pass", block_n=128, two_pass=dict(decode="bf16x2", block_v=64)),
             # the default with other weights buffers (64 MB since run 35: ~800 tokens a launch pair, 6 pairs at 4K;
             # H100 34e, the capped options: 8 MB 2,697 us, 16 MB 2,688, 32 MB 2,460, 64 MB 2,334; 35d: 128 MB 2,248)
             *(dict(layout="two_pass", two_pass=dict(decode="bf16x2"), weight_bytes=1 << m) for m in (24, 25, 27))]
# decode: entry splits + merge (run 7: 4 warps, 16-head blocks, heads layout 111-195 us); 64 heads: one decode
# (runs 17b-18b, entries layout: 32 heads x 64 / 32 entries in 1-2 splits 65.5-101 us, 64 x 32 in 2 splits
# 65.2 us); then the two-pass form (kernels/sparse_attn_decode.py; runs 20b/20c: 58.6 / 59.1 us at 1 tile a
# scoring program, 2 tiles 65.7, 5 tiles 62.1-62.6, DV 64 73-78, DV 256 on 8 warps 68.6-69.3, 8 warps 73.8-82.1).
# Run 24a, its bf16x2 form (the FP4 bytes assembled into bf16 pairs; 144 registers at 64-entry tiles): 39.3 us,
# with a 128-register cap 39.8, 2 stages 51.7, DV 64 under the cap 39.9, two tiles a program 38.4, DV 256 on 8
# warps 43.4; 128-entry tiles (255 registers, no spills) 34.6 = the default since; 256-entry tiles spill 2,972 B
ATTN_DECODE_CFGS = [dict(layout="two_pass", block_n=128, two_pass=dict(decode="bf16x2")),
                    dict(layout="entries", block_h=64, block_n=32, num_warps=8, split=2),
                    dict(layout="two_pass"),
                    dict(layout="two_pass", two_pass=dict(decode="bf16x2")),
                    dict(layout="two_pass", two_pass=dict(decode="bf16x2", maxnreg=128, tiles_per_program=2)),
                    # candidates after run 24a, at 128-entry tiles: 8 warps (250 / 144 registers, no spills);
                    # 64 output columns a pass-2 program (twice the programs); two tiles a scoring program
                    dict(layout="two_pass", block_n=128, two_pass=dict(decode="bf16x2", num_warps=8)),
                    dict(layout="two_pass", block_n=128, two_pass=dict(decode="bf16x2", block_v=64)),
                    dict(layout="two_pass", block_n=128, two_pass=dict(decode="bf16x2", tiles_per_program=2))]
# the prefill's one-pass wgmma form at this batch, staged (H100 run 48a, against the default's 36.5 us): 46.9 as one
# program a (token, head block), 36.4 in 2 splits of each token's entries merged after, 51.6 in 4, 65.0 in 4 at
# 32-entry tiles; no faster than the two passes, so the splits are gone (git show f860b6f:kernels/sparse_attn_wgmma.py)


def case_attn(bw, mm, cfgs=ATTN_CFGS, decode=True):
    """The 4K prefill over `cfgs`, then (decode) the decode case. `--only attn_prefill`: the prefill alone, over
    ATTN_PREFILL_CFGS (the two passes, the engine's staged form and the candidates beside it)."""
    h, d = 64, 512
    a = _attn_inputs(4096, 1 << 18, 4096 + 128)
    ref = attn_eager(*[x[:64] if x.dim() and x.shape[0] == 4096 else x for x in a])
    cfg, t, r = sweep("attn_cfgs", "attn", cfgs, lambda **c: sparse_attn.sparse_attn_triton(*a, **c),
                      lambda out: rel(ref, out[:64]), valid=lambda r: r < 1e-2, rep=100)
    te = bench(lambda: [attn_eager(*[x[c:c + 512] if x.dim() and x.shape[0] == 4096 else x for x in a])
                        for c in range(0, 4096, 512)], rep=100)
    flops = 4.0 * 4096 * h * 628 * d
    row("sparse attention prefill 4K (500 sel + 128 win)", t, flops / mm * 1e6, "bf16 MMA",
        f"{flops / t / 1e6:.0f} TFLOP/s; cfg {cfg}", te, f"rows 0-63 rel {r:.1e}", 700)
    if decode:
        case_attn_decode(bw, mm)


def case_attn_decode(bw, mm):
    """Decode, batch 64 (its own case too: `--only attn_decode`, what Nsight profiles with
    NCU_EXTRA="--nvtx --nvtx-include attn_decode_default/")."""
    h, d = 64, 512
    a = _attn_inputs(64, 1 << 18, 64 * 128)
    with torch.cuda.nvtx.range("attn_decode_default"):
        out = sparse_attn.sparse_attn_triton(*a)
        torch.cuda.synchronize()
    want = attn_eager(*a)
    chk = f"default rel {rel(want, out):.1e}"
    bestd, td, rbest = sweep("attn_decode_cfgs", "attn decode", ATTN_DECODE_CFGS,
                             lambda **c: sparse_attn.sparse_attn_triton(*a, **c), lambda o: rel(want, o),
                             valid=lambda r: r < 1e-2, graph=True)
    chk += f"; best cfg rel {rbest:.1e}"
    print(f"[kernels] attn decode {bestd}: {kernel_breakdown(lambda: sparse_attn.sparse_attn_triton(*a, **bestd))}",
          flush=True)
    te = bench(lambda: attn_eager(*a), graph=True)
    byt = 64 * (500 * 288 + 128 * 528 + 2 * h * d * 2)
    row("sparse attention decode, batch 64", td, byt / bw * 1e6, "HBM",
        f"{byt / td / 1e6:.2f} TB/s; cfg {bestd}", te, chk, 17)


def mhc_eager(x, fn, scale, base, pre_prev, y, post_old, comb_old):
    xs = (post_old[..., None] * y.float()[:, None, :] + torch.einsum("tij,tid->tjd", comb_old, x.float()))
    xn = xs.to(x.dtype)
    xs = xn.float()
    col = torch.einsum("tc,tcd->td", pre_prev, xs).to(x.dtype)
    flat = xs.flatten(1)
    m = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-20)
    return (xn, col, *mhc.sinkhorn_split_reference(m, scale, base))


# the engine's float32 stream at 4K tokens. Run 27a (H100): its default (BD 32, 3 stages, 8 warps) 348 us, BD 16 in
# 4 / 5 stages on 4 warps, orient "tokens", 475 / 462; run 29b (H100, the native cast): default 343.8, 32 x 32 tiles
# two blocks an SM (116 registers, 94 KB) 354.8. Now 16 warps (sm_90, triton 3.6: 100-128 registers, no spills)
MHC_WIDE_CFGS = [{}, {"num_warps": 16}]


def case_mhc(bw, mm, tokens=(4096, 64, 1)):
    """Sweeps the launch shapes that compile on triton 3.6 within the H200's shared memory (64x64 tiles
    in 2 stages, 64x32 in 3, 32x32 tiles two programs per SM, the second finishing launch); the row takes
    the fastest at fn cut in 3 bf16 pieces (the tested accuracy); at 4K also the engine's float32 stream."""
    dim = 5120
    # run 4 swept orient="tokens" at 2-3 stages (2 blocks an SM at BD 32 / 2 stages): 217-296 us against the
    # default's 208 (H200), BD 32 203. The default's stream tiles have one buffer at 2 stages (ttgir, triton 3.6),
    # refilled after the chunk's math; run 27a (H100) gave the tiles 3-7 buffers: default 247.5 us, orient "tokens"
    # BD 16 in 4-8 stages on 4 warps 296-313 (2 blocks an SM or 1), BD 32 / 4 stages 281 on 4 warps and 231.5 on 8,
    # 128-token blocks 299, BD 32 239. Deeper pipelines did not pay and more warps did. The loop's SASS (a 64 x 64
    # chunk: 1,426 instructions then, 1,019 since cast_rne compiles to the native cast) x 8 warps x 40 chunks, one
    # block an SM, filled 28% of the SM's issue slots at 208 us. Run 29a/29b (H100, the native cast): default 219.6 us,
    # 16 warps 228.1, orient "tokens" BD 32 / 4 stages on 8 warps 232.5 and on 16 431.0; 32 x 32 tiles two blocks an
    # SM (121 registers, 84 KB: four warps a scheduler) 286.8. Neither more warps nor more blocks pay now: not latency
    # at two warps a scheduler either
    tok = {"orient": "tokens"}
    sweep = {4096: [{}, {**tok, "block_d": 32, "num_stages": 4, "num_warps": 8}, {"num_warps": 16}],
             # 1 token (8.1 us in run 2, its default only): one warp a program keeps the finishing
             # program's Sinkhorn reductions inside a warp (shuffles, no barriers)
             # (H200 run 15: default, finish "launch", waves 1 / 2: 8.1 / 9.2 / 8.1 / 8.1 us; the warp
             # counts first now, the call's 60 s ran out before them)
             1: [{}, {"num_warps": 1}, {"num_warps": 2}, {"num_warps": 1, "waves": 2},
                 {"num_warps": 1, "block_d": 64}, {"finish": "launch"}, {"waves": 1}, {"waves": 2}],
             # the release layer's decode step (2 x 84 us there, run 6's profile: 10x its 1-token time)
             # run 13 at 16-token blocks (then the default): 40.3 us; waves 2/4 44.0/50.0; 32-token blocks 25.1,
             # 64-token 26.1; finish "launch" 40.9 (now 32-token blocks)
             64: [{}, {"token_block": 16}, {"token_block": 64}, {"waves": 0.5}, {"waves": 2}, {"block_d": 64},
                  {"token_block": 8}, {**tok, "block_d": 32, "num_stages": 2}]}
    logged_only = {4096: [], 1: [], 64: []}  # run 4 logged split 2 (2 bf16 pieces of fn): 188.5 us
    for tq, goal in ((1, 8), (64, "-"), (4096, 135)):  # the quickest compiles first: a cut-off run keeps them
        if tq not in tokens:
            continue
        x = torch.randn(tq, 4, dim, device=DEV).bfloat16()
        fn = torch.randn(24, 4 * dim, device=DEV) * 0.01
        scale, base = torch.rand(3, device=DEV) + 0.5, torch.randn(24, device=DEV) * 0.5
        pre_prev = torch.rand(tq, 4, device=DEV)
        y = torch.randn(tq, dim, device=DEV).bfloat16()
        post_old = torch.rand(tq, 4, device=DEV) * 2
        comb_old = torch.softmax(torch.randn(tq, 4, 4, device=DEV), -1)
        args = (x, fn, scale, base, pre_prev, y, post_old, comb_old)
        want = mhc_eager(*args)

        def timed(label, call, graph=False):
            """One configuration: (us, its errors against the eager outputs, their text), or None where it
            failed (logged)."""
            try:
                errs = [rel(a, b) for a, b in zip(want, call())]
                return bench(call, graph=graph), errs, "rel " + "/".join(f"{e:.0e}" for e in errs)
            except Exception as e:  # noqa: BLE001
                LOG["errors"].append(f"{label}: {e!r}"[:400])
                print(f"[sweep] {label}: failed {e!r}"[:300], flush=True)
                return None

        times, bad = {}, set()
        for cfg in sweep[tq] + logged_only[tq]:
            res = timed(f"mhc {tq} {cfg}", lambda: mhc.mhc_triton(*args, **cfg), graph=tq <= 64)
            if res is None:
                continue
            times[str(cfg)] = (res[0], res[2])
            if not max(res[1]) < 1e-3:  # logged, never the row's pick
                bad.add(str(cfg))
            print(f"[sweep] mhc {tq} {cfg}: {res[0]:.1f} us ({res[2]})", flush=True)
        LOG[f"mhc_cfgs_{tq}"] = times
        if tq == 64:  # in a decode step its inputs come cold from HBM (the MoE has swept L2): 41-44 us there
            flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
            t_flush = bench(lambda: flush.fill_(1), graph=True)
            for cfg in ({}, {"waves": 2}, {"waves": 4}, {"token_block": 16}):
                t_cold = bench(lambda: (flush.fill_(1), mhc.mhc_triton(*args, **cfg)), graph=True) - t_flush
                LOG.setdefault("mhc_64_cold_L2_us", {})[str(cfg)] = t_cold
                print(f"[cold L2] mhc 64 {cfg}: {t_cold:.1f} us", flush=True)
        ok = [str(c) for c in sweep[tq] if str(c) in times and str(c) not in bad]
        if not ok:
            raise RuntimeError(f"no mHC configuration ran at {tq} tokens (see the errors above)")
        best = min(ok, key=lambda c: times[c][0])
        t, chk = times[best]
        te = bench(lambda: mhc_eager(*args), graph=tq <= 64)
        byt = tq * (4 * dim * 2 * 2 + dim * 2 * 2) + fn.numel() * 4
        row(f"fused mHC (update+collapse+mixes+Sinkhorn), {tq} token{'s' if tq > 1 else ''}", t,
            byt / bw * 1e6, "HBM", f"{byt / t / 1e6:.2f} TB/s; cfg {best}", te, chk, goal)
        if tq == 4096:  # the engine's form (knob mhc_f32_stream): float32 streams of bf16 values, twice the bytes
            wargs = (x.float(), fn, scale, base, pre_prev, y.float(), post_old, comb_old)
            for cfg in MHC_WIDE_CFGS:
                res = timed(f"mhc 4096 float32 stream {cfg}", lambda: mhc.mhc_triton(*wargs, bf16_values=True, **cfg))
                if res is not None:
                    LOG.setdefault("mhc_wide_cfgs_4096", {})[str(cfg)] = (res[0], res[2])
                    print(f"[sweep] mhc 4096 float32 stream {cfg}: {res[0]:.1f} us, {2 * byt / res[0] / 1e6:.2f} "
                          f"TB/s ({res[2]})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="", help="comma-separated cases: quant, mhc, attn (attn_decode: its decode "
                    "half; attn_prefill: its prefill over the engine's form and the candidates beside it), indexer "
                    "(indexer_decode: its decode half), "
                    "topk, topk_layer (a 4K prefill's causal rows), moe (moe_decode: its decode rows), "
                    "moe_prefill (the engine's 4K forms alone), "
                    "linear, norm, engram, f32, run in the order given (default: all; topk is the top-512 sweep alone, "
                    "on its own logits)")
    ap.add_argument("--mhc-tokens", default="4096,64,1",
                    help="the mHC rows to sweep (the 4K sweep compiles ~16 shapes: ~5 minutes on a fresh machine)")
    args = ap.parse_args()
    mhc_tokens = tuple(int(v) for v in args.mhc_tokens.split(","))
    cases = dict(quant=case_quant, mhc=functools.partial(case_mhc, tokens=mhc_tokens), attn=case_attn,
                 attn_decode=case_attn_decode, indexer=case_indexer,
                 indexer_decode=functools.partial(case_indexer, prefill=False),
                 attn_prefill=functools.partial(case_attn, cfgs=ATTN_PREFILL_CFGS, decode=False), topk=case_topk,
                 topk_layer=case_topk_layer,
                 moe=case_moe, moe_decode=functools.partial(case_moe, prefill=False), moe_prefill=case_moe_prefill,
                 linear=case_linear,
                 norm=case_norm, engram=case_engram, f32=case_f32, router=case_router)
    unknown = set(args.only.split(",")) - set(cases) if args.only else set()
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; the cases: {', '.join(cases)}")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    LOG["device"] = f"{props.name}, {props.multi_processor_count} SMs"
    LOG["versions"] = f"torch {torch.__version__}, triton {triton.__version__}"
    LOG["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    bw, mm = ceilings()
    LOG["ceilings"] = dict(hbm_copy_TBps=bw / 1e12, bf16_mm_TFLOPs=mm / 1e12)
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    table = ""
    halves = ("attn_decode", "attn_prefill", "indexer_decode", "moe_decode")  # parts of cases: not run twice by default
    for name in args.only.split(",") if args.only else [c for c in cases if c not in halves]:
        fn = cases[name]
        t0 = time.time()
        try:
            fn(bw, mm)
        except Exception:  # noqa: BLE001
            LOG["errors"].append(f"{name}: {traceback.format_exc()[-1500:]}")
            print(f"[error] {name}\n{traceback.format_exc()[-1500:]}", flush=True)
        LOG.setdefault("case_s", {})[name] = round(time.time() - t0, 1)
        torch.cuda.empty_cache()
        table = write_results(args.out, bw, mm)  # after every case: a run cut off keeps what it measured
    print(json.dumps({k: v for k, v in LOG.items() if k not in ("rows",)}, default=str)[:3000])
    print(table)


def write_results(out: str, bw: float, mm: float) -> str:
    """kernels-table.md and kernels-log.json in `out` from LOG so far; returns the table."""
    lines = [f"# Kernel benchmarks, {LOG['device']}, {LOG['date']}", "",
             f"{LOG['versions']}. Ceilings measured in this run: HBM copy {bw / 1e12:.2f} TB/s (read+write), "
             f"bf16 matmul (8192^3) {mm / 1e12:.0f} TFLOP/s. Times are medians (do_bench; decode rows "
             "replay a CUDA graph). Floor = the limiting ceiling's time for the minimum bytes or FLOPs.", "",
             "| kernel, case | time (us) | floor (us) | % of ceiling | goal (us) | achieved | eager (us) | speed-up | check |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in LOG["rows"]:
        frac = 100 * r["floor_us"] / r["us"]
        eager = r["eager_us"]
        eager, sp = ("-", "-") if eager is None else (f"{eager:.0f}", f"{eager / r['us']:.1f}x")
        lines.append(f"| {r['name']} | {r['us']:.1f} | {r['floor_us']:.1f} ({r['limit']}) | {frac:.0f}% | "
                     f"{r['goal_us']} | {r['extra']} | {eager} | {sp} | {r['check']} |")
    if LOG["errors"]:
        lines += ["", "Errors:"] + [f"- {e.splitlines()[-1] if e else e}" for e in LOG["errors"]]
    table = "\n".join(lines)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernels-table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "kernels-log.json"), "w") as f:
        json.dump(LOG, f, indent=1, default=str)
    return table


if __name__ == "__main__":
    main()
