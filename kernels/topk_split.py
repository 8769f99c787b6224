"""The top-k's split path (kernels/topk.py's docstring): few long rows (decode), each row's work spread over many
programs. Three launches: the group maxima (`split_group_maxima`, unless the indexer's scoring kernel wrote them),
then `_filter_kernel` (each program a range of groups: the bound over all the row's maxima, the qualifying groups'
entries at or above it appended through one atomic counter a row), then `_resolve_kernel` (each program a slice of
the candidates: the k-th value and the tie cut over the whole buffer, each winner's output slot as the number of
winners at smaller positions)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import register_cap
from kernels.topk_search import _candidate_bound, _kth_key, _ordered_key, _pow2, _radix_select_row, _select_code

# select "hist" with 5-bit digits, the filter's bound from its first 4 of 7 (its top 17 bits: a bucket of 2^-8
# relative, a few more candidates than the exact bound's for three fewer dependent steps): a 1M-entry decode row's
# select on the scoring kernel's maxima (8,192 groups of 128) 35.5 us against 39.3 from 5 digits and 51.3 by counting
# (16 steps of three block counts; H100 run 44d; 44b: 8-bit digits from 2 of 4 44.4, 6-bit from 4 42.3; 44a: 8-bit
# digits 75.3, 4 warps 122.4), every form's picks the reference's. From 3 digits (12 bits: a bucket of 2^-3 relative)
# it took 30.5 us on the bench's random scores, but scores bunched within an eighth of the bound would pass the 2,048
# candidates and fall back to the radix select over the whole row (milliseconds): not the default. slice_len:
# candidates a resolve program ranks (each finds the k-th key over all of them): 32, where triton 3.7 spills the
# histogram form's 64 (32 B at 128 registers; 3.6: 150, no spill): 39.6 us against 43.2 (44b). filter_tile: entries a
# filter program reads at a time (its 4,096-entry block at once by default: 256 programs of 219 registers for a 1M row,
# two waves on 132 SMs; block 8,192 read 4,096 at a time is 128 programs, one wave: no faster, 45b; at once it spills).
# On the indexer decode's maxima since run 45b (2,048 groups of 512): 21.3 us, from 3 digits 21.1, counting 33.6.
# atomic_slots: each candidate's slot by an atomic of its own, where the tile's slots were numbered by a scan over its
# 4,096 entries (24% of the filter's stall samples, 45b): 18.6 us against 21.3, the 1M-key decode with its top-512 69.4
# against 71.5 (45c), 85 registers against 119
# groups: a row's group maxima (every filter program searches the bound over all of them): 2,048, where 8,192 had been
# the default; the select on the indexer decode's maxima 21.3 us at 2,048 (45b) against 35.5 at 8,192 (45a), the 1M-key
# decode with its top-512 77.5 against 95.4 (45a) and 85.0 at 4,096; 1,024 (2 x k, the least at top-512) 71.0 against
# 71.5 (45c)
# half_cap: the resolve finds the k-th key over its buffer's first half where the candidates fit there (the bench's
# ~600 of 2,048 slots): the select 16.3 us against 18.7, the 1M-key decode with its top-512 65.6 against 67.9 (H100
# run 46a). filter_maxnreg: 128 18.5 (46a), not the default
SPLIT_PATH_DEFAULTS = {"block": 4096, "groups": 2048, "num_warps": 8, "select": "hist", "hist_bits": 5,
                       "bound_steps": 4, "slice_len": 32, "filter_tile": 4096, "atomic_slots": True,
                       "half_cap": True, "filter_maxnreg": 0}

# the resolve's fallback (the exact radix select over a whole row, where its candidates overflow the buffer: many exact
# ties) in tiles of at most this many entries: at 4,096 triton 3.7 held the kernel to 128 registers and spilled 32 B
# (3.6: 150 registers, no spill); at 1,024 it takes 80, none spilled (the decode 96.2 us with it, 44d)
RADIX_BLOCK = 1024


@triton.jit
def _group_max_kernel(v_ptr, stride_v, n_cols, len_ptr, max_ptr, n_groups, cnt_ptr, chunk,
                      G: tl.constexpr, BLOCK: tl.constexpr, HAS_LEN: tl.constexpr):
    """Maxima of groups of G entries (-inf past the row's length) -> max_ptr[row, :n_groups]; zeroes
    the row's candidate counter. Grid (rows, column chunks of `chunk`, a multiple of BLOCK >= G)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    length = n_cols
    if HAS_LEN:
        length = tl.minimum(length, tl.load(len_ptr + row))
    if c == 0:
        tl.store(cnt_ptr + row, 0)
    base = v_ptr + row.to(tl.int64) * stride_v
    offs = tl.arange(0, BLOCK)
    gl = tl.arange(0, BLOCK // G)
    for start in range(c * chunk, tl.minimum(c * chunk + chunk, n_cols), BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < length, other=float("-inf"))
        m = tl.max(tl.reshape(x, (BLOCK // G, G)), axis=1)
        g = start // G + gl
        tl.store(max_ptr + row.to(tl.int64) * n_groups + g, m, mask=g < n_groups)


@triton.jit
def _append(cval_ptr, cidx_ptr, row, slot, cand, x, idx, CAP: tl.constexpr):
    """The candidates (cand, flat) x at positions idx (a tile, flattened here) into the row's buffer at their slots,
    those past CAP dropped (the count still holds them: the resolve falls back)."""
    ok = cand & (slot < CAP)
    tl.store(cval_ptr + row.to(tl.int64) * CAP + slot, tl.reshape(x, slot.shape), mask=ok)
    tl.store(cidx_ptr + row.to(tl.int64) * CAP + slot, tl.reshape(idx, slot.shape), mask=ok)


@triton.jit
def _filter_kernel(v_ptr, stride_v, n_cols, len_ptr, max_ptr, n_groups, cnt_ptr, cval_ptr, cidx_ptr,
                   K: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, GPP: tl.constexpr, GB: tl.constexpr,
                   CAP: tl.constexpr, HAS_LEN: tl.constexpr, SEL: tl.constexpr = 0, HBITS: tl.constexpr = 8,
                   BSTEPS: tl.constexpr = 0, SUB: tl.constexpr = 0, ATOMIC_SLOTS: tl.constexpr = False):
    """Program (row, c) takes groups [c*GPP, (c+1)*GPP), SUB at a time (0: all at once): reads the entries of those
    whose maximum reaches the bound (GB columns at a time), appends the candidates to the row's buffer via its counter.
    Every program finds the bound itself (BSTEPS: `_candidate_bound`'s digits): redundant work on idle SMs, no launch
    between. ATOMIC_SLOTS: each candidate takes its slot by an atomic of its own (the buffer is unordered); else a
    tile's slots are reserved by one atomic and numbered by a scan over the tile."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    length = n_cols
    if HAS_LEN:
        length = tl.minimum(length, tl.load(len_ptr + row))
    mrow = max_ptr + row.to(tl.int64) * n_groups
    gi = tl.arange(0, NGP)
    t1 = _candidate_bound(tl.load(mrow + gi, mask=gi < n_groups, other=float("-inf")), K, SEL, HBITS, BSTEPS)
    S: tl.constexpr = GPP if SUB == 0 else SUB
    base = v_ptr + row.to(tl.int64) * stride_v
    for s0 in tl.static_range(0, GPP, S):
        g = c * GPP + s0 + tl.arange(0, S)
        mo = tl.load(mrow + g, mask=g < n_groups, other=float("-inf"))
        qual = (mo > float("-inf")) & (_ordered_key(mo) >= t1)
        if tl.sum(qual.to(tl.int32), axis=0) > 0:
            for j0 in tl.static_range(0, G, GB):
                idx = g[:, None] * G + j0 + tl.arange(0, GB)[None, :]  # [S, GB]
                ok = qual[:, None] & (idx < length)
                x = tl.load(base + idx, mask=ok, other=float("-inf"))
                cand = ok & (x > float("-inf")) & (_ordered_key(x) >= t1)
                cand = tl.reshape(cand, (S * GB,))
                # relaxed: a slot reservation needs only atomicity (the slots are read by the next launch)
                if ATOMIC_SLOTS:
                    slot = tl.atomic_add(cnt_ptr + row + tl.zeros([S * GB], tl.int32), 1, mask=cand, sem="relaxed")
                    _append(cval_ptr, cidx_ptr, row, slot, cand, x, idx, CAP)
                else:
                    n_c = tl.sum(cand.to(tl.int32), axis=0)
                    if n_c > 0:
                        slot = tl.atomic_add(cnt_ptr + row, n_c, sem="relaxed") \
                            + tl.cumsum(cand.to(tl.int32), axis=0) - 1
                        _append(cval_ptr, cidx_ptr, row, slot, cand, x, idx, CAP)


@triton.jit
def _resolve_slice(cval_ptr, cidx_ptr, out_row, row, sl, n_cand, n_sel, CAP: tl.constexpr, W: tl.constexpr,
                   SL: tl.constexpr, SEL: tl.constexpr, HBITS: tl.constexpr):
    """The winners among slots [sl*SL, (sl+1)*SL) of the row's buffer of n_cand <= W candidates (its stride CAP),
    each written at its rank by position among all winners (`_resolve_kernel`)."""
    s = tl.arange(0, W)
    ok = s < n_cand
    x = tl.load(cval_ptr + row.to(tl.int64) * CAP + s, mask=ok, other=float("-inf"))
    p = tl.load(cidx_ptr + row.to(tl.int64) * CAP + s, mask=ok, other=0)
    key = _ordered_key(x)
    inv = (p ^ -1).to(tl.uint32, bitcast=True)  # larger = earlier position
    thr = _kth_key(key, ok, tl.maximum(n_sel, 1), SEL, HBITS)
    gt = ok & (key > thr)
    eq = ok & (key == thr)
    need_eq = n_sel - tl.sum(gt.to(tl.int32), axis=0)  # >= 1
    cut = tl.zeros([], dtype=tl.uint32)
    if tl.sum(eq.to(tl.int32), axis=0) > need_eq:
        cut = _kth_key(inv, eq, need_eq, SEL, HBITS)
    sel = gt | (eq & (inv >= cut))
    m = sl * SL + tl.arange(0, SL)
    okm = m < n_cand
    xm = tl.load(cval_ptr + row.to(tl.int64) * CAP + m, mask=okm, other=float("-inf"))
    pm = tl.load(cidx_ptr + row.to(tl.int64) * CAP + m, mask=okm, other=0)
    km = _ordered_key(xm)
    selm = okm & ((km > thr) | ((km == thr) & ((pm ^ -1).to(tl.uint32, bitcast=True) >= cut)))
    slot = tl.sum((sel[None, :] & (p[None, :] < pm[:, None])).to(tl.int32), axis=1)
    tl.store(out_row + slot, pm, mask=selm)


@triton.jit
def _resolve_kernel(v_ptr, stride_v, n_cols, len_ptr, cnt_ptr, cval_ptr, cidx_ptr, out_ptr,
                    K: tl.constexpr, CAP: tl.constexpr, SL: tl.constexpr, BLOCK: tl.constexpr,
                    BITS: tl.constexpr, HAS_LEN: tl.constexpr, SEL: tl.constexpr = 0, HBITS: tl.constexpr = 8,
                    HALF: tl.constexpr = False):
    """Program (row, s): the winners among candidate slots [s*SL, (s+1)*SL) of the row's (unordered)
    buffer, each written at its rank by position among all winners. Winners: value desc, then position
    asc; the K-th value and the tie cut found by counting over the whole buffer (HALF: over its first half, where
    the candidates fit there)."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    n_cand = tl.load(cnt_ptr + row)
    out_row = out_ptr + row.to(tl.int64) * K
    n_sel = tl.minimum(n_cand, K)
    if n_cand <= CAP:
        if sl == 0:
            slots = tl.arange(0, K)
            tl.store(out_row + slots, tl.full([K], -1, tl.int32), mask=slots >= n_sel)
        if sl * SL < n_cand:
            if HALF and n_cand <= CAP // 2:
                _resolve_slice(cval_ptr, cidx_ptr, out_row, row, sl, n_cand, n_sel, CAP, CAP // 2, SL, SEL, HBITS)
            else:
                _resolve_slice(cval_ptr, cidx_ptr, out_row, row, sl, n_cand, n_sel, CAP, CAP, SL, SEL, HBITS)
    elif sl == 0:
        length = n_cols
        if HAS_LEN:
            length = tl.minimum(length, tl.load(len_ptr + row))
        _radix_select_row(v_ptr + row.to(tl.int64) * stride_v, tl.maximum(length, 0), out_row, K, BLOCK, BITS)


def split_group_maxima(values, lens, n_groups: int, g: int, block: int, chunk: int | None):
    """The group maxima of values [R, L] (groups of g, -inf past lens) and zeroed candidate counters -> (maxima
    [R, n_groups], counts [R]); chunk: entries a program (None: ~512 programs over all rows)."""
    r, n = values.shape
    maxima = torch.empty(r, n_groups, dtype=torch.float32, device=values.device)
    counts = torch.empty(r, dtype=torch.int32, device=values.device)
    mblock = max(min(block, 1024), g)
    if chunk is None:
        chunk = mblock * max(1, triton.cdiv(n, mblock * max(1, triton.cdiv(512, r))))
    chunk = -(-max(chunk, mblock) // mblock) * mblock
    _group_max_kernel[(r, triton.cdiv(n, chunk))](values, values.stride(0), n, lens if lens is not None else counts,
                                                  maxima, n_groups, counts, chunk, G=g, BLOCK=mblock,
                                                  HAS_LEN=lens is not None)
    return maxima, counts


def split_select(values, k: int, lens, maxima, counts, cval, cidx, out, bits: int = 8, **form) -> torch.Tensor:
    """The filter and resolve launches over given maxima [R, n_groups] and zeroed counts (kernels/topk.py
    `select_from_maxima`); candidate buffers cval / cidx [R, cap]; writes out [R, k]. form: SPLIT_PATH_DEFAULTS' knobs
    (None: the default's), groups aside (the maxima are given). block: entries a filter program
    (its groups' share of the row), read filter_tile entries at a time (more entries a program, fewer programs: at
    most one wave of them); atomic_slots: a filter slot a candidate (else a tile's by a scan); half_cap: the resolve
    searches the buffer's first half where the candidates fit there; filter_maxnreg: the filter's register cap (0:
    none)."""
    unknown = set(form) - set(SPLIT_PATH_DEFAULTS)
    if unknown:
        raise TypeError(f"split_select: no knob {sorted(unknown)} (knobs: {sorted(SPLIT_PATH_DEFAULTS)})")
    opt = {**SPLIT_PATH_DEFAULTS, **{key: v for key, v in form.items() if v is not None}}
    r, n = values.shape
    n_groups = maxima.shape[1]
    g = _pow2(-(-n // n_groups))
    cap = cval.shape[1]
    sel, hbits, nw = _select_code(opt["select"]), opt["hist_bits"], opt["num_warps"]
    gpp = max(1, opt["block"] // g)
    has_len = lens is not None
    lens = lens if has_len else counts
    _filter_kernel[(r, triton.cdiv(n_groups, gpp))](values, values.stride(0), n, lens, maxima, n_groups, counts,
                                                    cval, cidx, K=k, NGP=_pow2(n_groups),
                                                    G=g, GPP=gpp, GB=min(g, opt["block"]), CAP=cap,
                                                    HAS_LEN=has_len, SEL=sel, HBITS=hbits,
                                                    BSTEPS=opt["bound_steps"] if sel == 1 else 0,
                                                    SUB=min(gpp, max(1, opt["filter_tile"] // min(g, opt["block"]))),
                                                    ATOMIC_SLOTS=bool(opt["atomic_slots"]),
                                                    num_warps=nw, **register_cap(opt["filter_maxnreg"]))
    sl = min(opt["slice_len"], cap)
    _resolve_kernel[(r, cap // sl)](values, values.stride(0), n, lens, counts, cval, cidx, out, K=k, CAP=cap,
                                    SL=sl, BLOCK=min(opt["block"], RADIX_BLOCK), BITS=bits, HAS_LEN=has_len, SEL=sel,
                                    HBITS=hbits, HALF=bool(opt["half_cap"]) and cap & (cap - 1) == 0 and cap >= 2 * sl,
                                    num_warps=nw)
    return out
