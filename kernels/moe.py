"""FP4 weight-only routed-expert MoE: grouped GEMMs over the tokens routed to each expert.

Shapes (release: E = 384 experts, dim = 5120, I = 2304, top-6):
  x             bf16 [T, dim]
  w1, w3        int8 [E, I, dim/2]   w1_scale, w3_scale float8_e8m0fnu [E, I, dim/32]
  w2            int8 [E, dim, I/2]   w2_scale float8_e8m0fnu [E, dim, I/32]
  topk_ids      int32 [T, k]         topk_weights float32 [T, k] (already normalized and scaled)
                (a negative id: a slot another process computes, expert parallel; it adds nothing here)
out[t] = sum_k w[t,k] * W2_e (silu(min(W1_e x, L)) * clamp(W3_e x, -L, L)), e = topk_ids[t,k], L = 10;
float32 [T, dim]. Weights are decoded from FP4 in registers; activations stay bf16.

Two paths (moe_fp4_triton picks by the number of (token, expert) pairs P = T * k):
- few pairs (decode): GEMV on CUDA cores, split-K (kernels/moe_gemv.py).
- many pairs (prefill): grouped tensor-core GEMM per expert block of tokens (moe_align), the weight tile
  decoded once per program and K step. Swap-AB: the decoded weight tile [BN rows, BK] is the wgmma's
  register A operand (M = weight rows) and the token tile the shared-memory B operand (N = tokens), so
  the decoded (joined/reshaped) tile never needs an NVMMA shared layout: on triton 3.6 the plain
  orientation (decoded tile as the transposed B operand) fails in TritonGPUOptimizeDotOperands with
  "Illegal shared layout ... collapsedTmaShape [2, 2048]" (the joins' [.., 2] shape given an MMA
  shared layout).
FP4 weights are decoded in registers by kernels/fp4_tiles.py (bit assembly; the tensor-core path's K
order inside each 8-group is NIB: position 2 A + half holds index A + 4 half, so x is permuted the same
way once on the host and h is stored permuted by the gate/up kernel). Loading each lane's wgmma A
fragment's words directly, with K relabelled into the MMA's order (no shared-memory round trip in the
SASS), was exact but lost on the H200 (run 19a: prefill 4K tokens 18.5 vs 9.6 ms, the 64-token decode
step 6.8-8.2 vs 2.6 ms) and is gone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine import quant as Q
from kernels import moe_f8, moe_gemv
from kernels._formats import dot_dtype, register_cap
from kernels.quant import fp8_roundtrip_triton
from kernels.fp4_tiles import (decode_form, fp4_bytes_folded, fp4_decoded, fp4_decoded_folded, fp4_dot_scaled,
                               fp4_tile, fp4_words, nib_order, nib_position)


def _check(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights):
    t, dim = x.shape
    e, inter, half = w1.shape
    if half * 2 != dim or w3.shape != w1.shape or w2.shape != (e, dim, inter // 2):
        raise ValueError(f"MoE weight shapes disagree with x [{t}, {dim}]: w1 {tuple(w1.shape)}, "
                         f"w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}")
    if w1_scale.shape != (e, inter, dim // 32) or w2_scale.shape != (e, dim, inter // 32):
        raise ValueError("MoE scale shapes must be [E, I, dim/32] and [E, dim, I/32]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError("topk_ids and topk_weights must both be [T, k]")
    return t, dim, e, inter, topk_ids.shape[1]


def moe_fp4_reference(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights,
                      swiglu_limit: float = 10.0, fp8_mma: bool = False, hidden: str | None = None,
                      x_on_grid: bool = False, bf16_decode=None, split_m=None, block_n=None, maxnreg=None,
                      down_block_n=None, down_maxnreg=None, split_n=None, split_maxnreg=None):
    """Dequantize each used expert, run it on its tokens (float64 on the CPU, float32 elsewhere); with
    `hidden` (or fp8_mma) in the engine's numerics (kernels/moe_f8.py), as those forms compute (x rounded
    to the E4M3-per-32 grid here whatever x_on_grid says: exact where it holds). bf16_decode, split_m, block_n,
    maxnreg, down_*, split_*: the kernel's weight decode, tiles and launches, the same values in every form (ignored
    here)."""
    del bf16_decode, split_m, block_n, maxnreg, down_block_n, down_maxnreg, split_n, split_maxnreg
    t, dim, e, inter, k = _check(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights)
    hidden = _hidden(hidden, fp8_mma)
    if hidden is not None:
        return moe_f8.moe_f8_reference(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights,
                                       swiglu_limit, bf16_acts=hidden == "reference")
    cdt = torch.float64 if x.device.type == "cpu" else torch.float32
    out = torch.zeros(t, dim, dtype=cdt, device=x.device)
    xf = x.to(cdt)
    for ex in torch.unique(topk_ids).tolist():
        if ex < 0:  # another rank's expert
            continue
        tok, slot = (topk_ids == ex).nonzero(as_tuple=True)
        a = Q.dequantize_fp4(w1[ex], w1_scale[ex], 32).to(cdt)
        b = Q.dequantize_fp4(w3[ex], w3_scale[ex], 32).to(cdt)
        c = Q.dequantize_fp4(w2[ex], w2_scale[ex], 32).to(cdt)
        xe = xf[tok]
        h = F.silu((xe @ a.T).clamp(max=swiglu_limit)) * (xe @ b.T).clamp(-swiglu_limit, swiglu_limit)
        out.index_add_(0, tok, (h @ c.T) * topk_weights[tok, slot].to(cdt)[:, None])
    return out.float()


GEMV_MAX_PAIRS = 16  # moe_fp4_triton's default: up to this many (token, expert) pairs take the GEMV path


def _hidden(hidden: str | None, fp8_mma: bool) -> str | None:
    """The hidden state's numerics: None (the bf16 form's own: w * h unquantized, w after the down GEMM),
    "reference" or "fp32" (engine/model/moe.py under those numerics: w * h quantized to E4M3 per 32; the
    reference's bf16 roundings of gate, up, w * h and each expert's output). The FP8 form: "reference"
    unless told."""
    if hidden not in (None, "reference", "fp32"):
        raise ValueError(f"unknown hidden-state numerics {hidden!r}: None, 'reference' or 'fp32'")
    return "reference" if hidden is None and fp8_mma else hidden


def token_block(pairs: int, experts: int) -> int:
    """The grouped GEMM's default token block: 16 at a decode step's widths (up to four pairs an expert), 64 for a
    prefill's (the width split_m applies to)."""
    return 16 if pairs <= 4 * experts else 64


def fp8_form_pays(pairs: int, experts: int, gemv_max_pairs: int = 16) -> bool:
    """Whether the FP8 form beats the bf16 form at this width (H200 run 16c, both with the engine's hidden
    state): the decode step's grouped widths, 16-token blocks (64 tokens: 2.45 vs 2.67 ms); not the GEMV
    widths (1 token: 210 vs 102 us) nor prefill (4K tokens: 13.8 vs 9.4 ms)."""
    return gemv_max_pairs < pairs <= 4 * experts


def moe_align(topk_ids: torch.Tensor, n_experts: int, block_m: int, split_m: int | None = None):
    """Group (token, slot) pairs by expert into row blocks of block_m; no host sync (graph-safe).

    Returns order int32 [P] (pair ids sorted by expert), and per block: expert (-1 = unused),
    first and end row in `order`, each int32 [NB] with NB = min(P, ceil(P/block_m) + min(E + 1, P)).
    Negative ids (slots computed elsewhere) are grouped after the last expert, in unused blocks.
    split_m: two block lists over the same order -> (order, small, big), each (expert, first, end): experts
    with at most block_m pairs in blocks of block_m, the others in blocks of split_m."""
    order, counts, row_start = _sorted_pairs(topk_ids, n_experts)
    groups, p = counts.numel(), topk_ids.numel()
    if split_m is None:
        return (order, *_blocks(counts, row_start, block_m, n_experts, p))
    small = counts <= block_m
    # tighter lists than _blocks' general bound (each block past the used ones is a program that only exits: at a
    # 4K prefill ~20,000 of a launch's ~28,000): a small group takes one block; a crowded one (> block_m pairs) takes
    # ceil(n / split_m) blocks, at most n / block_m where split_m >= 2 block_m
    crowded = (p // block_m if split_m >= 2 * block_m
               else min(p, -(-p // split_m) + min(groups, p // (block_m + 1))))
    return (order, _blocks(torch.where(small, counts, 0), row_start, block_m, n_experts, p, min(groups, p)),
            _blocks(torch.where(small, 0, counts), row_start, split_m, n_experts, p, max(crowded, 1)))


def moe_align_classes(topk_ids: torch.Tensor, n_experts: int, block_m: int, sizes: tuple[int, ...]):
    """As moe_align's split lists, in token blocks of several sizes: each expert's pairs in blocks of the largest
    size but its last block, which takes the smallest of (block_m, *sizes) that holds what is left. A 4K prefill's
    ~Poisson(64) experts then fill 64, 80 and 96-pair blocks where 64 and 128 left a 128-pair tile ~56% empty.
    sizes: ascending, past block_m. Returns (order, [(expert, first, end) for block_m, then each size]); no host
    sync (graph-safe)."""
    classes = (block_m, *sizes)
    if not sizes or any(a >= b for a, b in zip(classes, classes[1:])):
        raise ValueError(f"tile sizes {sizes} must be ascending and past block_m {block_m}")
    order, counts, row_start = _sorted_pairs(topk_ids, n_experts)
    groups, p, top = counts.numel(), topk_ids.numel(), classes[-1]
    full = torch.clamp(counts - 1, min=0) // top  # the largest blocks before an expert's last one
    rest = counts - full * top  # its last block's pairs: 1 .. top (0: no pairs)
    cls = sum((rest > size).long() for size in classes[:-1])  # the smallest class that holds them
    lists = []
    for c, size in enumerate(classes):
        last = torch.where((cls == c) & (rest > 0), rest, 0)
        if c == len(classes) - 1:  # the largest: the full blocks too
            nb = min(p, -(-p // top) + min(groups, p // (classes[-2] + 1)))
            lists.append(_blocks(full * top + last, row_start, size, n_experts, p, max(nb, 1)))
        else:  # one block an expert whose last block is this size, which holds more than the size below
            nb = min(groups, p // (classes[c - 1] + 1) if c else p)
            lists.append(_blocks(last, row_start + full * top, size, n_experts, p, max(nb, 1)))
    return order, lists


def _sorted_pairs(topk_ids: torch.Tensor, n_experts: int):
    """(order int32 [P]: pair ids sorted by expert, negative ids after the last; counts [E + 1]; each group's first
    row in order), graph-safe."""
    groups = n_experts + 1  # the last group: the negative ids
    flat = topk_ids.flatten().long()
    flat = torch.where(flat < 0, n_experts, flat)
    # narrow keys: torch's radix sort makes one pass per key byte (int64: 26.5 us for 384 pairs on the
    # H200, the decode step's largest glue kernel)
    key_dtype = torch.int16 if groups <= torch.iinfo(torch.int16).max else torch.int32
    order = torch.argsort(flat.to(key_dtype), stable=True).to(torch.int32)
    # scatter_add, not bincount: bincount reads the max back to the host, which breaks graph capture
    counts = torch.zeros(groups, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts, torch.cumsum(counts, 0) - counts


def _blocks(counts, row_start, block_m: int, n_experts: int, p: int, nb: int | None = None):
    """Each group's pairs (counts, from row_start in the sorted order) in blocks of block_m -> (expert, first,
    end) int32 [NB]; a group counted 0 gets no block. nb: the blocks the list holds (by default a bound for any
    counts: ceil(p / block_m) + one partial block a group), at least those the counts make."""
    groups = counts.numel()
    nblk = (counts + block_m - 1) // block_m
    blk_cum = torch.cumsum(nblk, 0)
    nb = min(p, -(-p // block_m) + min(groups, p)) if nb is None else nb
    b = torch.arange(nb, device=counts.device)
    e_of_b = torch.searchsorted(blk_cum, b, right=True).clamp(max=groups - 1)
    within = b - (blk_cum[e_of_b] - nblk[e_of_b])
    begin = row_start[e_of_b] + within * block_m
    end = torch.minimum(begin + block_m, row_start[e_of_b] + counts[e_of_b])
    used = (b < blk_cum[-1]) & (e_of_b < n_experts)
    expert = torch.where(used, e_of_b, -1).to(torch.int32)
    return expert, begin.to(torch.int32), end.to(torch.int32)


# -- prefill path: grouped tensor-core GEMM ----------------------------------------------------------

@triton.jit
def _block_ids(NBM, NBN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (token block, N block): GROUP_M consecutive token blocks (mostly one expert) sweep
    all N blocks together, so each weight tile is fetched from HBM about once and their x stays in L2."""
    pid = tl.program_id(0)
    per_group = GROUP_M * NBN
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(NBM - first, GROUP_M)
    mb = first + (pid % per_group) % size
    nb = (pid % per_group) // size
    return mb, nb


@triton.jit
def _moe_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, h_ptr,
                        tw_ptr, limit, NBM, DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                        GROUP_M: tl.constexpr, BD: tl.constexpr, SC: tl.constexpr, FH: tl.constexpr,
                        RB: tl.constexpr):
    mb, nb = _block_ids(NBM, (INTER + BN - 1) // BN, GROUP_M)
    e = tl.load(bexp_ptr + mb)
    if e < 0:
        return
    r0 = tl.load(bbeg_ptr + mb)
    r1 = tl.load(bend_ptr + mb)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r1
    pair = tl.load(order_ptr + rows, mask=rmask, other=0)
    tok = pair // TOPK
    n_idx = nb * BN + tl.arange(0, BN)
    n_mask = n_idx < INTER
    grow = e.to(tl.int64) * INTER + n_idx
    # swap-AB: the decoded weight tile is the register A operand (M = BN weight rows), the token tile
    # the shared-memory B operand (N = BM tokens); accumulators are [BN, BM]
    acc1 = tl.zeros([BN, BM], tl.float32)
    acc3 = tl.zeros([BN, BM], tl.float32)
    kk = tl.arange(0, BK)
    for k0 in range(0, DIM, BK):
        # x is in NIB order (permuted on the host), like the decoded tiles (natural order for SC)
        xt = tl.load(x_ptr + tok[:, None].to(tl.int64) * DIM + (k0 + kk)[None, :], mask=rmask[:, None],
                     other=0.0).to(DT)
        if SC:
            acc1 = fp4_dot_scaled(w1_ptr, s1_ptr, grow, n_mask, k0, tl.trans(xt), acc1, DIM, BK)
            acc3 = fp4_dot_scaled(w3_ptr, s3_ptr, grow, n_mask, k0, tl.trans(xt), acc3, DIM, BK)
        elif BD == 2:
            w1c, s1c = fp4_bytes_folded(w1_ptr, s1_ptr, grow, n_mask, k0, DIM, BK)
            w3c, s3c = fp4_bytes_folded(w3_ptr, s3_ptr, grow, n_mask, k0, DIM, BK)
            acc1 = tl.dot(fp4_decoded_folded(w1c, s1c, BK), tl.trans(xt), acc1)
            acc3 = tl.dot(fp4_decoded_folded(w3c, s3c, BK), tl.trans(xt), acc3)
        else:
            w1c, s1c = fp4_words(w1_ptr, s1_ptr, grow, n_mask, k0, DIM, BK, BD)  # both loads before a decode
            w3c, s3c = fp4_words(w3_ptr, s3_ptr, grow, n_mask, k0, DIM, BK, BD)
            acc1 = tl.dot(fp4_decoded(w1c, s1c, BK, DT, BD), tl.trans(xt), acc1)
            acc3 = tl.dot(fp4_decoded(w3c, s3c, BK, DT, BD), tl.trans(xt), acc3)
    if FH:  # the engine's hidden state, w included
        h = moe_f8.swiglu_e4m3_values(acc1, acc3, tl.load(tw_ptr + pair, mask=rmask, other=0.0), limit, BN, BM, RB)
    else:
        g = tl.minimum(acc1, limit)
        u = tl.minimum(tl.maximum(acc3, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
    # stored in NIB order along I: the down kernel's decoded w2 tiles expect it (SC: natural order)
    col = n_idx if SC else nib_position(n_idx)
    tl.store(h_ptr + rows[None, :].to(tl.int64) * INTER + col[:, None],
             h.to(h_ptr.dtype.element_ty), mask=rmask[None, :] & n_mask[:, None])


@triton.jit
def _moe_down_kernel(h_ptr, w2_ptr, s2_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, tw_ptr, out_ptr, NBM,
                     DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                     GROUP_M: tl.constexpr, BD: tl.constexpr, SC: tl.constexpr, FH: tl.constexpr,
                     RB: tl.constexpr):
    mb, nb = _block_ids(NBM, (DIM + BN - 1) // BN, GROUP_M)
    e = tl.load(bexp_ptr + mb)
    if e < 0:
        return
    r0 = tl.load(bbeg_ptr + mb)
    r1 = tl.load(bend_ptr + mb)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r1
    pair = tl.load(order_ptr + rows, mask=rmask, other=0)
    tok = pair // TOPK
    n_idx = nb * BN + tl.arange(0, BN)
    n_mask = n_idx < DIM
    grow = e.to(tl.int64) * DIM + n_idx
    acc = tl.zeros([BN, BM], tl.float32)  # swap-AB as in the gate/up kernel: [weight rows, tokens]
    kk = tl.arange(0, BK)
    for k0 in range(0, INTER, BK):
        ht = tl.load(h_ptr + rows[:, None].to(tl.int64) * INTER + (k0 + kk)[None, :], mask=rmask[:, None],
                     other=0.0).to(DT)
        if SC:
            acc = fp4_dot_scaled(w2_ptr, s2_ptr, grow, n_mask, k0, tl.trans(ht), acc, INTER, BK)
        elif BD == 2:
            w2c, s2c = fp4_bytes_folded(w2_ptr, s2_ptr, grow, n_mask, k0, INTER, BK)
            acc = tl.dot(fp4_decoded_folded(w2c, s2c, BK), tl.trans(ht), acc)
        else:
            acc = tl.dot(fp4_tile(w2_ptr, s2_ptr, grow, n_mask, k0, INTER, BK, DT, BD), tl.trans(ht), acc)
    if FH:  # w is in h already; each expert's output as the numerics' act stores it
        y = moe_f8.act(acc, RB)
    else:
        y = acc * tl.load(tw_ptr + pair, mask=rmask, other=0.0)[None, :]
    # relaxed: nothing in this launch reads out, so no fence before each add (acq_rel, the default, put a
    # MEMBAR.ALL.GPU before each of a thread's 16 four-wide adds in the sm_90 SASS)
    tl.atomic_add(out_ptr + tok[None, :].to(tl.int64) * DIM + n_idx[:, None], y, mask=rmask[None, :] & n_mask[:, None],
                  sem="relaxed")


def _grouped_ws(xp, w1, w3, w2, s1, s3, s2, scales_t, order, tiles, tw, h, out, limit, k, which: str, bf16_acts,
                x_rs: bool | str = False, **form):
    """The GEMMs `which` ("both", "gate_up", "down") of every tile list in the warp-specialized form
    (kernels/moe_ws.py; form: grouped_ws's group_m, stages, block_k, decoders), or ("rs") both in the
    register-operand form (kernels/moe_rs.py: group_m, stages and maxnreg of `form`, block_k its stage_k; x_rs: xp
    is in its MMA order already)."""
    from kernels import moe_ws
    if scales_t is None:
        scales_t = tuple(moe_ws.cached_transposed_scales(s, w.shape[0]) for s, w in ((s1, w1), (s3, w3), (s2, w2)))
    flat = [w.view(-1, w.shape[-1]) for w in (w1, w3, w2)]
    if which == "rs":  # both GEMMs in the register-operand form: act and h in its MMA order along K
        from kernels import moe_rs
        rs_form = {key: form[key] for key in ("group_m", "stages", "maxnreg") if key in form}
        rs_form["stage_k"] = form.get("block_k", 64)
        x_sorted = (xp if x_rs else moe_rs.rs_columns(xp)).index_select(0, order.long() // k)
        for blocks, bm, bn, *_ in tiles:
            moe_rs.grouped_rs(x_sorted, flat[:2], scales_t[:2], order, blocks, h, bm, tw=tw.view(-1), limit=limit,
                              block_n=bn, bf16_acts=bf16_acts, **rs_form)
        for blocks, bm, _, dbn, *_ in tiles:
            moe_rs.grouped_rs(h, flat[2:], scales_t[2:], order, blocks, out, bm, topk=k, block_n=dbn,
                              bf16_acts=bf16_acts, **rs_form)
        return
    if which != "down":
        x_sorted = xp.index_select(0, order.long() // k)  # one activation row a pair, in expert order
        for blocks, bm, bn, *_ in tiles:
            moe_ws.grouped_ws(x_sorted, flat[:2], scales_t[:2], order, blocks, h, bm, tw=tw.view(-1), limit=limit,
                              block_n=bn, bf16_acts=bf16_acts, **form)
    if which != "gate_up":
        for blocks, bm, _, bn, *_ in tiles:
            moe_ws.grouped_ws(h, flat[2:], scales_t[2:], order, blocks, out, bm, topk=k, block_n=bn,
                              bf16_acts=bf16_acts, **form)


def _ws_form(ws, possible: bool) -> str | None:
    """moe_fp4_triton's `ws` as the GEMMs it names ("both", "gate_up", "down") or None; refused where the form cannot
    run (it computes the engine's hidden state on a GPU's bf16 MMA: not the scaled or FP8 forms, not the
    interpreter)."""
    forms = {True: "both", False: None, "gate_up": "gate_up", "down": "down", "rs": "rs"}
    if ws not in forms:
        raise ValueError(f"ws must be one of {list(forms)}, got {ws!r}")
    if forms[ws] is not None and not possible:
        raise ValueError("ws: the warp-specialized form computes the engine's hidden state (hidden set) on a GPU's "
                         "bf16 MMA: not with the scaled or FP8 forms, nor under the interpreter")
    return forms[ws]


def _words(w: torch.Tensor) -> torch.Tensor:
    """Packed FP4 bytes [..., K/2] seen as int32 words [..., K/8] (8 nibbles each, no copy)."""
    w = w.contiguous()
    return w.view(torch.int32)


def moe_fp4_triton(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights,
                   swiglu_limit: float = 10.0, block_m: int | None = None, block_n: int | None = None,
                   block_k: int = 64, num_warps: int = 4, num_stages: int = 3, group_m: int = 4,
                   gemv_max_pairs: int = GEMV_MAX_PAIRS, gemv_block_n: int = 16, gemv_block_kw: int = 128,
                   gemv_iters: int = 1, gemv_down_block_n: int = 16, gemv_down_block_kw: int = 32,
                   gemv_down_iters: int = 3, gemv_num_warps: int = 4, gemv_prefetch: bool = False,
                   gemv_down_num_warps: int | None = None, maxnreg: int | None = None, bf16_decode: bool | str = True,
                   scaled: bool = False, fp8_mma: bool = False, hidden: str | None = None,
                   x_on_grid: bool = False, split_m: int | tuple | None = None, down_block_n: int | None = None,
                   down_maxnreg: int | None = None, split_n: int | None = None, split_maxnreg: int | None = None,
                   ws: bool | str = False, scales_t: tuple | None = None, ws_stages: int = 4, ws_block_k: int = 64,
                   ws_decoders: int = 1, ws_maxnreg: int | None = None, ws_decode_regs: int = 96,
                   ws_persistent: int = 0, rs_round_trip: bool = False, gemv_x_split: bool = False):
    """Routed experts on FP4 weights (module docstring). P = T*k <= gemv_max_pairs: the GEMV path
    (gemv_* knobs; 16-row gate/up blocks: 73.9 vs 81.0 us at 8 rows in run 12, once each scale byte
    was loaded once; 8 rows had won by 3% before; 16-row down blocks: 72.4 vs 74.0 us at 32 rows in
    H200 run 14, 72.6 vs 74.4 in run 13b); otherwise the grouped GEMM (block_m tokens x
    block_n rows x block_k, group_m).
    gemv_prefetch (run 4's candidate): each GEMV program loops over its gemv_iters K steps with the
    next step's loads issued before this step's decode (`_gemv_rows_prefetch`), so long K slices
    (few or no K splits, fewer atomics) keep loads in flight; gemv_down_num_warps: the down kernel's
    warps (default gemv_num_warps). maxnreg: a register cap for the grouped GEMM's kernels (more
    programs per SM); bf16_decode (default; where the dots run in bf16, i.e. not under the
    interpreter): the grouped GEMM decodes FP4 straight into bf16 bits, no float32 round trip (H200
    run 11: 2.68 vs 3.00 ms at the 64-token decode step, 10.3 vs 10.6 ms at 4K tokens; bit-exact, checked
    in benches/kernels.py); bf16_decode="fold": the bf16 bits by PTX with the scale folded into one bf16x2
    multiply a pair (fp4_tiles.fp4_decoded_folded: ~10% fewer instructions in the grouped GEMM's loops on
    sm_90; H200 run 24a: 9.66 against 9.83 ms at 4K tokens, 2.62 against 2.66 at the 64-token step; the
    engine's default through TritonOps.moe_fold), for scale bytes up to fp4_tiles.FOLD_MAX_SCALE_BYTE
    (beyond: NaN; fold_fits checks);
    scaled: the grouped GEMM hands the raw FP4 and E8M0 bytes to tl.dot_scaled
    (Triton's MXFP4 path; on the GPU only, the interpreter keeps the bit-assembly decode); fp8_mma: the
    grouped GEMMs on FP8 tensor cores (kernels/moe_f8.py); hidden ("reference" / "fp32", `_hidden`): the
    engine's numerics in either form (only the order of sums differs), grouped at every width; x_on_grid:
    x is on the E4M3-per-32 grid already (the engine's `linear(x, None)`), so the bf16 form's round trip
    (kernels/quant.py fp8_roundtrip_triton) is skipped.
    split_m (the bf16 grouped GEMM): an expert with more than block_m pairs in tiles of split_m tokens x
    block_n * block_m / split_m weight rows (the same MMA area), the others as before: its weight tiles decoded once
    for up to split_m tokens (a 4K prefill's experts hold ~64 pairs, Poisson: about half need two 64-token
    blocks). Two launches a GEMM, over the same sorted pairs. split_n, split_maxnreg: the split tiles' weight rows
    (both GEMMs) and register cap (0: none), in place of the same MMA area and the other tiles' caps: 128 x 64 split
    tiles beside narrow 64 x 64 ones (whose same-area split tiles, 128 x 32 under their cap, spill). split_m a tuple
    of sizes (ws="rs" only, e.g. (80, 96, 128)): token blocks of block_m and each size (moe_align_classes: an
    expert's last block the smallest that holds it), split_n (default block_n) weight rows a tile past block_m.
    down_block_n, down_maxnreg: the down GEMM's weight rows a tile and register cap (default: block_n's, maxnreg's):
    its 64 x 64 tiles take 101 registers on sm_90, 4 programs an SM, where 64 x 128 takes 178, 2.
    ws (the bf16 grouped GEMM with the engine's hidden state, on a Hopper GPU): both GEMMs ("gate_up", "down": that
    one alone) in the warp-specialized Gluon form (kernels/moe_ws.py: the FP4 decode in warps of its own, the
    activation gathered once into expert order), block_n / down_block_n weight rows a tile, ws_stages shared-memory
    stages of ws_block_k, ws_decoders decoding warp groups of ws_decode_regs registers, ws_maxnreg the launch's,
    ws_persistent programs an SM looping over tiles (0: a program a tile); scales_t: the transposed E8M0 copies of
    w1_scale, w3_scale and w2_scale (moe_ws.transposed_scales; when not given, made once a scale tensor and kept
    while it lives: moe_ws.cached_transposed_scales). ws="rs": both GEMMs in the register-operand Gluon form
    (kernels/moe_rs.py: each FP4 tile decoded straight into the wgmma's A fragment; ws_stages and ws_maxnreg apply,
    ws_block_k is the K of a ring stage, 64 or 128); rs_round_trip: x's E4M3 round trip stores it in that form's MMA
    order itself (quant.fp8_roundtrip_triton rs=True) instead of a permuting copy after it (where x is already on
    the grid there is no round trip, and the copy stays). gemv_x_split: the GEMV's gate/up reads x from a copy in
    the order the down reads h in (moe_gemv.split_vector; at 32-word steps, gemv_block_kw=32, its loads go straight
    into the FMAs' layout; untimed, off)."""
    t, dim, e, inter, k = _check(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, topk_ids, topk_weights)
    form = decode_form(bf16_decode)  # the grouped GEMM's weight decode (the GEMV path has its own)
    p = t * k
    hidden = _hidden(hidden, fp8_mma)
    fp8_hidden = hidden is not None
    which = _ws_form(ws, fp8_hidden and not fp8_mma and not scaled and dot_dtype() == tl.bfloat16)
    if fp8_mma:  # the FP8 form has no GEMV: grouped at every width
        gemv_max_pairs = 0
    # x on the E4M3-per-32 grid, as the reference's GEMM sees it (the FP8 form quantizes x itself); the grouped
    # GEMM's round trip stores in the decoders' nibble order below (and the rs form's MMA order), at no extra pass
    round_x = fp8_hidden and not fp8_mma and not x_on_grid
    if rs_round_trip and which != "rs":
        raise ValueError("rs_round_trip: x stored in the register-operand form's order, for that form (ws='rs') alone")
    if dim % 32 or inter % 32:
        raise ValueError(f"dim {dim} and I {inter} must be multiples of the FP4 group 32")
    u8 = torch.uint8
    w1w, w3w, w2w = _words(w1), _words(w3), _words(w2)
    s1, s3, s2 = (s.contiguous().view(u8) for s in (w1_scale, w3_scale, w2_scale))
    tw = topk_weights.float().contiguous()
    if p <= gemv_max_pairs:
        xg = fp8_roundtrip_triton(x, 32, bf16_out=True) if round_x else x
        return moe_gemv.moe_gemv(
            xg, w1w, s1, w3w, s3, w2w, s2, topk_ids, tw, swiglu_limit, hidden, block_n=gemv_block_n,
            block_kw=gemv_block_kw, iters=gemv_iters, down_block_n=gemv_down_block_n,
            down_block_kw=gemv_down_block_kw, down_iters=gemv_down_iters, num_warps=gemv_num_warps,
            down_num_warps=gemv_down_num_warps, prefetch=gemv_prefetch, x_split=gemv_x_split)
    if block_m is None:
        block_m = token_block(p, e)
    if block_n is None:  # weight rows are the wgmma M: at least 64 (the FP8 form: 128 halves its waits per row)
        block_n = 64 if block_m == 16 and not fp8_mma else 128
    down_block_n = down_block_n or block_n
    if fp8_hidden and block_n % 32:
        raise ValueError(f"the reference's hidden state is quantized per 32 rows: block_n {block_n} must hold "
                         "row blocks of whole groups")
    bk = min(block_k, inter, dim)
    if dim % bk or inter % bk or bk % 32:
        raise ValueError(f"dim {dim} and I {inter} must be multiples of the K block {bk} (a multiple of 32)")
    dt = dot_dtype()
    if fp8_mma:
        return moe_f8.grouped_f8(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, tw, moe_align(topk_ids, e, block_m),
                                 swiglu_limit, block_m=block_m, block_n=block_n, block_k=bk, group_m=group_m,
                                 num_warps=num_warps, num_stages=num_stages, interpreted=dt != tl.bfloat16,
                                 launch_options=register_cap(maxnreg), bf16_acts=hidden == "reference")
    down_cap = maxnreg if down_maxnreg is None else down_maxnreg
    block_tile = (block_m, block_n, down_block_n, maxnreg, down_cap)  # a tile list's (token block, rows, caps)
    caps = (maxnreg, down_cap) if split_maxnreg is None else (split_maxnreg,) * 2  # the bigger token blocks'
    if split_m is None:
        order, *blocks = moe_align(topk_ids, e, block_m)
        tiles = [(blocks, *block_tile)]
    elif isinstance(split_m, tuple):  # tile classes: token blocks of block_m and each size (moe_align_classes)
        if which != "rs":
            raise ValueError(f"split_m {split_m}: token blocks of several sizes run in the register-operand form "
                             "(ws='rs') alone")
        up_n = down_n = split_n or block_n
        order, lists = moe_align_classes(topk_ids, e, block_m, split_m)
        tiles = [(lists[0], *block_tile)] + [(blocks, size, up_n, down_n, *caps)
                                             for blocks, size in zip(lists[1:], split_m)]
    else:
        if split_n is None:
            if (block_n * block_m) % split_m or (down_block_n * block_m) % split_m:
                raise ValueError(f"split_m {split_m}: {block_n} (down {down_block_n}) x {block_m} weight rows must "
                                 "divide by it (the split tiles' same MMA area)")
            up_n, down_n = block_n * block_m // split_m, down_block_n * block_m // split_m
        else:
            up_n = down_n = split_n
        if split_m <= block_m or min(up_n, down_n) < 16 or (fp8_hidden and up_n % 32):
            raise ValueError(f"split_m {split_m}: more tokens than block_m {block_m}, and {up_n} (down {down_n}) "
                             "weight rows a split tile, at least 16 (whole 32-row groups for the hidden state)")
        order, small, big = moe_align(topk_ids, e, block_m, split_m)
        tiles = [(small, *block_tile), (big, split_m, up_n, down_n, *caps)]
    out = torch.zeros(t, dim, dtype=torch.float32, device=x.device)
    h = torch.empty(p, inter, dtype=torch.bfloat16 if dt == tl.bfloat16 else torch.float32, device=x.device)
    sc = bool(scaled) and dt == tl.bfloat16  # the interpreter has no dot_scaled
    rs_x = rs_round_trip and round_x  # x leaves its round trip in the rs form's order (which is never scaled)
    if round_x:
        xp = fp8_roundtrip_triton(x, 32, bf16_out=True, nib=not sc, rs=rs_x)
    else:
        xp = x.contiguous() if sc else nib_order(x.contiguous())
    if sc:  # raw FP4 bytes for dot_scaled instead of int32 words
        w1w, w3w, w2w = (w.contiguous().view(u8) for w in (w1, w3, w2))
    bd = form if dt == tl.bfloat16 and not sc else 0  # the interpreter's dots run in float32
    shared = dict(DIM=dim, INTER=inter, TOPK=k, BK=bk, DT=dt, GROUP_M=group_m, BD=bd, SC=sc, FH=fp8_hidden,
                  RB=hidden == "reference", num_warps=num_warps, num_stages=num_stages)
    for (bexp, bbeg, bend), bm, bn, _, cap, _ in (tiles if which in (None, "down") else []):
        nbm = bexp.numel()
        _moe_gate_up_kernel[(nbm * triton.cdiv(inter, bn),)](
            xp, w1w, s1, w3w, s3, order, bexp, bbeg, bend, h, tw, float(swiglu_limit), nbm, BM=bm, BN=bn, **shared,
            **register_cap(cap))
    if which is not None:
        _grouped_ws(xp, w1, w3, w2, w1_scale, w3_scale, w2_scale, scales_t, order, tiles, tw, h, out, swiglu_limit, k,
                    which, hidden == "reference", group_m=group_m, stages=ws_stages, block_k=ws_block_k,
                    decoders=ws_decoders, maxnreg=ws_maxnreg, decode_regs=ws_decode_regs, persistent=ws_persistent,
                    x_rs=rs_x)
    for (bexp, bbeg, bend), bm, _, bn, _, cap in (tiles if which in (None, "gate_up") else []):
        nbm = bexp.numel()
        _moe_down_kernel[(nbm * triton.cdiv(dim, bn),)](
            h, w2w, s2, order, bexp, bbeg, bend, tw, out, nbm, BM=bm, BN=bn, **shared, **register_cap(cap))
    return out
