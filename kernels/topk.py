"""Top-k selection kept in position order, -1 padded.

`topk_positions_reference(values, k, lengths)` and `topk_positions_triton(...)` take scores
[R, L] float32 where -inf marks entries that may not be chosen, and return int32 [R, k]: the
positions of the min(k, #finite) largest scores, ascending, then -1. Ties at the threshold go to the
earliest positions.

The Triton version never sorts (Triton's tl.sort of 2048 keys costs tens of microseconds in one
program). Both paths start from group maxima: the row is cut into groups of G entries (a power of
two); the k-th largest group maximum t1 is a lower bound of the row's k-th largest value (k groups
hold an entry >= t1), so every winner lies in a group whose maximum is >= t1: about k groups, so
only ~k*G entries are read again. The k-th largest key of a set is found by histograms of 5-bit digits (7 steps,
`_kth_largest_key_hist`; both paths' default) or by counting (select="count": 16 steps of three counts fix the
32-bit ordered key two bits at a time, `_kth_largest_key`). A row short enough (whole_row: a 4K prefill's
indexer rows) skips the groups: one search over the row as one register tile.
  rows path (R >= ROWS_MIN, prefill): one program per row does it all: group maxima (unless the
     indexer's scoring kernel wrote them), t1, the qualifying groups' entries >= t1 appended in
     position order to a per-row buffer, the exact k-th value among them, and the winners written by
     a running count (they are already in position order).
  split path (few long rows, decode; kernels/topk_split.py): the group maxima (from the scoring kernel or
     `split_group_maxima`), then a filter launch (each program a range of groups, candidates appended through one
     atomic counter a row), then a resolve launch (each winner's output slot by counting smaller positions).
The k-th key searches both paths share are in kernels/topk_search.py.
More than `cap` candidates (many exact ties) fall back to the exact radix select over the row.
No host tensor is made or copied per call: the entry points can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import register_cap
from kernels.topk_search import _candidate_bound, _kth_key, _ordered_key, _pow2, _radix_select_row, _select_code
from kernels.topk_split import SPLIT_PATH_DEFAULTS, split_group_maxima, split_select


def topk_positions_reference(values: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
                             **_tune) -> torch.Tensor:
    """values [R, L] float -> int32 [R, k]; entries at or past lengths[r] count as -inf (the kernel's
    launch knobs, `_tune`, change nothing here)."""
    r, n = values.shape
    v = values.double().clone()
    if lengths is not None:
        v[torch.arange(n, device=v.device)[None, :] >= lengths.to(v.device).long()[:, None]] = float("-inf")
    # rank by (value desc, position asc): a stable sort on value gives the earliest positions at ties; each row's
    # first min(k, #finite) of that order, then in position order (n past them: sorted last, then -1)
    order = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :k]
    n_ok = (v > float("-inf")).sum(1, keepdim=True).clamp_max(k)
    picks = torch.sort(torch.where(torch.arange(order.shape[1], device=v.device) < n_ok, order, n), dim=1).values
    out = torch.full((r, k), -1, dtype=torch.int32, device=values.device)
    out[:, :picks.shape[1]] = torch.where(picks == n, -1, picks).to(torch.int32)
    return out


@triton.jit
def _select_in_order(x, p, ok, out_row, K: tl.constexpr, SEL: tl.constexpr, HBITS: tl.constexpr):
    """The top-K of a tile's values x at positions p (ascending where ok) -> out_row[0:K], in position
    order, -1 padded: the K-th key by `_kth_key`, ties by their running rank, winners by their running
    count. A tile of at most K valid entries takes them all, no search."""
    key = _ordered_key(x)
    count = tl.sum(ok.to(tl.int32), axis=0)
    n_sel = tl.minimum(count, K)
    if count > K:
        thr = _kth_key(key, ok, n_sel, SEL, HBITS)
    else:
        thr = tl.zeros([], dtype=tl.uint32)  # every valid key is above it (the least, -inf's, is 0x007FFFFF)
    gt = ok & (key > thr)
    eq = ok & (key == thr)
    need_eq = n_sel - tl.sum(gt.to(tl.int32), axis=0)
    sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need_eq))
    slot = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(out_row + slot, p, mask=sel)
    slots = tl.arange(0, K)
    tl.store(out_row + slots, tl.full([K], -1, tl.int32), mask=slots >= n_sel)


@triton.jit
def _row_select_kernel(v_ptr, stride_v, n_cols, len_ptr, max_ptr, n_groups, glist_ptr, cval_ptr, cidx_ptr,
                       out_ptr, K: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                       CAP: tl.constexpr, BITS: tl.constexpr, HAS_LEN: tl.constexpr, HAS_MAX: tl.constexpr,
                       SEL: tl.constexpr = 0, HBITS: tl.constexpr = 8, WHOLE: tl.constexpr = False,
                       BSTEPS: tl.constexpr = 0, HALF: tl.constexpr = False, WHOLE_HALF: tl.constexpr = False,
                       MB: tl.constexpr = 2048):
    """One row per program: group maxima (HAS_MAX: given), bound, qualifying groups listed in order,
    their candidates appended in position order, the exact top-K among them written in order.
    Scratch rows: max_ptr [NGP-ish] (n_groups), glist_ptr [CAP], cval/cidx [CAP]. SEL: how the two
    k-th keys (bound, threshold) are found: 0 counting (16 steps of 3 block reductions), 1 HBITS-bit
    histograms. WHOLE (n_cols <= BLOCK): the row is one register tile and its top-K is found on it
    directly, one k-th key instead of two, no scratch. BSTEPS: the bound's search steps (`_candidate_bound`); HALF:
    rows whose candidates fill at most half the buffer searched over that half (a second inlined search);
    WHOLE_HALF: a whole row of at most BLOCK / 2 entries taken as a tile half as wide (the same); MB: entries a step
    of the group maxima's pass (not HAS_MAX)."""
    row = tl.program_id(0)
    length = n_cols
    if HAS_LEN:
        length = tl.minimum(length, tl.load(len_ptr + row))
    base = v_ptr + row.to(tl.int64) * stride_v
    out_row = out_ptr + row.to(tl.int64) * K
    if WHOLE:
        if WHOLE_HALF and length <= BLOCK // 2:  # a short row (a prefill's first half): a tile half as wide
            _select_whole(base, length, out_row, K, BLOCK // 2, SEL, HBITS)
        else:
            _select_whole(base, length, out_row, K, BLOCK, SEL, HBITS)
    else:
        _select_by_groups(base, row, n_cols, length, max_ptr, n_groups, glist_ptr, cval_ptr, cidx_ptr, out_row,
                          K, NGP, G, BLOCK, CAP, BITS, HAS_MAX, SEL, HBITS, BSTEPS, HALF, MB)


@triton.jit
def _select_by_groups(base, row, n_cols, length, max_ptr, n_groups, glist_ptr, cval_ptr, cidx_ptr, out_row,
                      K: tl.constexpr, NGP: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                      BITS: tl.constexpr, HAS_MAX: tl.constexpr, SEL: tl.constexpr, HBITS: tl.constexpr,
                      BSTEPS: tl.constexpr, HALF: tl.constexpr, MB: tl.constexpr):
    """`_row_select_kernel`'s row through its group maxima (see there)."""
    offs = tl.arange(0, BLOCK)
    mrow = max_ptr + row.to(tl.int64) * n_groups
    if not HAS_MAX:  # the row's group maxima, MB entries a step as a [groups, G] tile: a warp reduces each group
        # in registers and shuffles (a 1-D tile reshaped went through shared memory and two barriers a step)
        gl = tl.arange(0, MB // G)
        for start in range(0, n_cols, MB):
            g = start // G + gl
            idx = g[:, None] * G + tl.arange(0, G)[None, :]
            x = tl.load(base + idx, mask=idx < length, other=float("-inf"))
            tl.store(mrow + g, tl.max(x, axis=1), mask=g < n_groups)
        tl.debug_barrier()  # the maxima are read back by other threads of this program
    gi = tl.arange(0, NGP)
    mx = tl.load(mrow + gi, mask=gi < n_groups, other=float("-inf"))
    t1 = _candidate_bound(mx, K, SEL, HBITS, BSTEPS)
    qual = (mx > float("-inf")) & (_ordered_key(mx) >= t1)
    n_q = tl.sum(qual.to(tl.int32), axis=0)
    grow = glist_ptr + row.to(tl.int64) * CAP
    qslot = tl.cumsum(qual.to(tl.int32), axis=0) - 1
    tl.store(grow + qslot, gi, mask=qual & (qslot < CAP))
    tl.debug_barrier()
    crow = row.to(tl.int64) * CAP
    count = 0
    if n_q <= CAP:  # else each qualifying group holds a candidate: overflow for sure
        gsub = offs // G
        within = offs % G
        for q0 in range(0, n_q, BLOCK // G):
            idx, ok = _group_chunk(grow, q0, gsub, within, n_q, length, G)
            x = tl.load(base + idx, mask=ok, other=float("-inf"))
            cand = ok & (x > float("-inf")) & (_ordered_key(x) >= t1)
            pos = count + tl.cumsum(cand.to(tl.int32), axis=0) - 1
            keep = cand & (pos < CAP)
            tl.store(cval_ptr + crow + pos, x, mask=keep)
            tl.store(cidx_ptr + crow + pos, idx, mask=keep)
            count += tl.sum(cand.to(tl.int32), axis=0)
        tl.debug_barrier()
    if HALF and (n_q <= CAP) & (count <= CAP // 2):  # the search over half the buffer where the candidates fit
        _select_from_buffer(cval_ptr + crow, cidx_ptr + crow, count, out_row, K, CAP // 2, SEL, HBITS)
    elif (n_q <= CAP) & (count <= CAP):
        _select_from_buffer(cval_ptr + crow, cidx_ptr + crow, count, out_row, K, CAP, SEL, HBITS)
    else:
        _radix_select_row(base, tl.maximum(length, 0), out_row, K, BLOCK, BITS)


@triton.jit
def _select_whole(base, length, out_row, K: tl.constexpr, W: tl.constexpr, SEL: tl.constexpr, HBITS: tl.constexpr):
    """The top-K of a row of `length` (<= W) entries taken as one [W] register tile."""
    offs = tl.arange(0, W)
    x = tl.load(base + offs, mask=offs < length, other=float("-inf"))
    _select_in_order(x, offs, x > float("-inf"), out_row, K, SEL, HBITS)


@triton.jit
def _group_chunk(grow, q0, gsub, within, n_q, length, G: tl.constexpr):
    """The entries of qualifying groups q0 .. (listed at grow) as a tile: their positions and whether each is there."""
    qi = q0 + gsub
    gq = tl.load(grow + qi, mask=qi < n_q, other=0)
    idx = gq * G + within
    return idx, (qi < n_q) & (idx < length)


@triton.jit
def _select_from_buffer(cval, cidx, count, out_row, K: tl.constexpr, W: tl.constexpr, SEL: tl.constexpr,
                        HBITS: tl.constexpr):
    """The top-K of a row's first `count` (<= W) candidates, buffered in position order."""
    s = tl.arange(0, W)
    ok = s < count
    x = tl.load(cval + s, mask=ok, other=float("-inf"))
    _select_in_order(x, tl.load(cidx + s, mask=ok, other=0), ok, out_row, K, SEL, HBITS)


ROWS_MIN = 64  # rows at or above this: one program per row (prefill); below: split path (decode)


def group_size(n: int, groups: int = 2048) -> int:
    """Entries per group-maximum for a row of n (a power of two, about `groups` groups)."""
    return _pow2(max(1, -(-n // groups)))


# The rows path's defaults: the fastest of the top-512 sweep over 4K x 64K logits on the H200
# (benches/kernels.py --only topk, benches/results/kernels-h200-topk.md: 1,148 us in the second sweep
# against 1,309 for the first sweep's winner, block 1024 with 4 warps, and 1,550 for block 4096, 4096
# groups, 16 warps, "count"). The split path (decode rows) keeps its own.
# maxnreg 64: 4 rows of 8 warps resident per SM instead of 2 (126 registers uncapped): 933 vs 1,149 us
# over 4K x 64K on the H200 (benches/results/kernels-h200-run8.md)
# hist_bits: the histogram search's digit width, 5 (7 steps) since H100 run 41a, every row exact: 4K x 64K 859.7 us
# against 982.8 at 8 bits (6 bits: 901.0); a 4K prefill's causal rows over 4,096 entries 303.8 against 385.6, over
# 2,048 214.0 against 250.8 (benches/results/kernels-h100-run41a-topk.md). whole_row: the longest row taken as one
# register tile (0: none; the engine asks for it by knob, topk_whole_row), its own launch options (whole_warps,
# whole_maxnreg: 0 uncapped); bound_steps: the candidates' bound from that many digits (0: all; 5 of 7: its top 22
# bits, a bucket of 2^-13 relative, a few more candidates); half_tile: the final search over half the candidate
# buffer where a row's candidates fit it. H100 run 41d, 4K x 64K (every checked row exact): both 793.8 us against
# 858.4 (half_tile alone 806.6, bound_steps=5 alone 840.2); then 4,096 groups: 762.3 us against 795.5 at 2,048 (run
# 41e; loading the candidates' entries a chunk ahead: 818.0 at 2,048 groups, 750.8 at 4,096, 757.0 in 41g against
# 773.6, within its noise: dropped). whole_half: whole rows of at most half the tile's width on a tile half as wide
# (41e, the layer's causal rows over 4,096 / 2,048 entries: 193.2 / 95.3 us against 236.0 / 110.2)
# max_block: the group maxima's pass 16,384 entries a step (2 barriers a row where 2,048 took 32), under an 80-register
# cap (3 rows an SM; 84 B of spills against 396): 4K x 64K 608.6 us against 765.5 at 2,048 and 64 registers, 621.8 at
# 8,192 (H100 run 42c; 42b: 8,192 621.5 against 763.0)
ROWS_PATH_DEFAULTS = {"block": 2048, "groups": 4096, "num_warps": 8, "select": "hist", "maxnreg": 80,
                      "hist_bits": 5, "whole_row": 0, "whole_warps": 8, "whole_maxnreg": 0, "bound_steps": 5,
                      "half_tile": True, "whole_half": True, "max_block": 16384}


def default_groups(rows: int) -> int:
    """Group maxima per row for the path these rows take (the indexer's fused maxima too): more groups, fewer
    entries re-read (~k groups qualify), a dearer bound."""
    return (ROWS_PATH_DEFAULTS if rows >= ROWS_MIN else SPLIT_PATH_DEFAULTS)["groups"]


def select_from_maxima(values, k, lengths, maxima, counts, cap: int = 2048, block: int | None = None,
                       bits: int = 8, rows_path: bool | None = None, slice_len: int | None = None,
                       num_warps: int | None = None, select: str | None = None,
                       maxnreg: int | None = None, **form) -> torch.Tensor:
    """Top-k of values [R, L] given maxima [R, n_groups] of groups of G = ceil-pow2(L / n_groups)
    entries, and counts int32 [R] already zeroed (split path). -> int32 [R, k].
    The maxima buffer is scratch afterwards (the rows path lists group ids over it).
    select: how the k-th keys are found, "count" (2 bits a step) or "hist" (histograms of digits);
    maxnreg: the rows path's register cap (0: none); form: hist_bits, bound_steps and the rows path's others
    (`topk_positions_triton`; no whole-row tile here, the maxima being given). Unset knobs: ROWS_PATH_DEFAULTS or
    SPLIT_PATH_DEFAULTS (the indexer's 4K x 64K prefill select: 668 us tuned vs 1,370 us with the split
    path's knobs, benches/results/kernels-h200-run8.md)."""
    r, n = values.shape
    dev = values.device
    n_groups = maxima.shape[1]
    g = _pow2(-(-n // n_groups))
    if triton.cdiv(n, g) != n_groups:
        raise ValueError(f"{n_groups} group maxima do not tile a row of {n} in power-of-two groups")
    ngp = _pow2(n_groups)
    cap = max(min(_pow2(cap), _pow2(n)), k)  # a row never has more candidates than entries
    rows_path = r >= ROWS_MIN if rows_path is None else rows_path
    defaults = ROWS_PATH_DEFAULTS if rows_path else SPLIT_PATH_DEFAULTS
    block, num_warps = block or defaults["block"], num_warps or defaults["num_warps"]
    sel = _select_code(select or defaults["select"])
    maxnreg = defaults.get("maxnreg") if maxnreg is None else maxnreg
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    lens = lengths if lengths is not None else dummy
    cval = torch.empty(r, cap, dtype=torch.float32, device=dev)
    cidx = torch.empty(r, cap, dtype=torch.int32, device=dev)
    out = torch.empty(r, k, dtype=torch.int32, device=dev)
    if rows_path:
        _, launch = _rows_launch(n, block, num_warps, maxnreg, {**form, "whole_row": 0})  # the maxima are given
        glist = torch.empty(r, cap, dtype=torch.int32, device=dev)
        _row_select_kernel[(r,)](values, values.stride(0), n, lens, maxima, n_groups, glist, cval, cidx, out,
                                 K=k, NGP=ngp, G=g, BLOCK=max(block, g), CAP=cap, BITS=bits,
                                 HAS_LEN=lengths is not None, HAS_MAX=True, SEL=sel, **launch)
        return out
    split_form = {key: v for key, v in form.items() if key in SPLIT_PATH_DEFAULTS and key != "groups"}
    return split_select(values, k, lengths, maxima, counts, cval, cidx, out, bits=bits, block=block,
                        slice_len=slice_len, num_warps=num_warps, select=select, **split_form)


def _rows_launch(n: int, block: int, num_warps: int | None, maxnreg: int | None, form: dict,
                 g: int = 1) -> tuple[int, dict]:
    """The rows path's form for rows of n in groups of g: (the whole-row tile's width, 0 where the row is not taken
    whole; the launch's HBITS, num_warps, register cap and maxima pass width), unset knobs from ROWS_PATH_DEFAULTS."""
    opt = {**ROWS_PATH_DEFAULTS, **{key: v for key, v in form.items() if v is not None}}
    whole = _pow2(n) if 0 < n <= opt["whole_row"] else 0
    if whole:  # the half-width tile only where it is a tile at all
        return whole, {"HBITS": opt["hist_bits"], "WHOLE_HALF": bool(opt["whole_half"]) and whole >= 32,
                       "num_warps": opt["whole_warps"], **register_cap(opt["whole_maxnreg"])}
    return whole, {"HBITS": opt["hist_bits"], "BSTEPS": opt["bound_steps"], "HALF": bool(opt["half_tile"]),
                   "MB": max(_pow2(opt["max_block"]), g), "num_warps": num_warps or opt["num_warps"],
                   **register_cap(opt["maxnreg"] if maxnreg is None else maxnreg)}


def topk_positions_triton(values: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
                          block: int | None = None, bits: int = 8, cap: int = 2048, groups: int | None = None,
                          rows_path: bool | None = None, chunk: int | None = None, select: str | None = None,
                          **tune) -> torch.Tensor:
    """Triton twin of `topk_positions_reference`. values [R, L] float32 (row stride may exceed L).
    Knobs: block (entries per tile), cap (candidate buffer per row), groups (group maxima per row),
    bits (the radix fallback's digit width), rows_path (force a path), chunk (entries per group-maxima
    program on the split path), select ("count": the k-th keys by 16 counting steps; "hist": by histograms
    of hist_bits-bit digits, 4 steps at 8). tune: slice_len, num_warps, maxnreg (rows path: a register cap, so
    that more rows are resident per SM; ncu, run 6: 126 registers held the kernel to 2 rows of 8 warps),
    hist_bits, whole_row (rows path: rows of at most this many entries taken as one register tile, one k-th key
    search over it, launched with whole_warps and whole_maxnreg), bound_steps (rows path: the candidates' bound
    from the first this many digits of its search only, 0 all), half_tile (rows path: a row's candidates searched
    over half the buffer where they fit it), whole_half (whole rows of at most half the tile on a tile half as wide),
    max_block (rows path: entries a step of the group maxima's pass).
    Defaults per path: ROWS_PATH_DEFAULTS, SPLIT_PATH_DEFAULTS."""
    if values.dim() != 2 or values.dtype != torch.float32 or values.stride(1) != 1:
        raise ValueError("values must be a row-major float32 [R, L] tensor")
    if k & (k - 1):
        raise ValueError(f"k must be a power of two, got {k}")
    r, n = values.shape
    dev = values.device
    lens = lengths.to(device=dev, dtype=torch.int32).contiguous() if lengths is not None else None
    rows_path = r >= ROWS_MIN if rows_path is None else rows_path
    defaults = ROWS_PATH_DEFAULTS if rows_path else SPLIT_PATH_DEFAULTS
    block = block or defaults["block"]
    select = select or defaults["select"]
    groups = max(_pow2(groups or defaults["groups"] or default_groups(r)), 2 * k)
    g = group_size(n, groups)
    n_groups = triton.cdiv(n, g)
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    if rows_path:
        whole, launch = _rows_launch(n, block, tune.pop("num_warps", None), tune.pop("maxnreg", None), tune, g)
        out = torch.empty(r, k, dtype=torch.int32, device=dev)
        cap = max(min(_pow2(cap), _pow2(n)), k)
        # the whole-row tile needs no scratch: the maxima, the group list and the candidates are never touched
        maxima, cval, cidx, glist = ((dummy,) * 4 if whole else
                                     (torch.empty(r, w, dtype=dt, device=dev) for w, dt in (
                                         (n_groups, torch.float32), (cap, torch.float32), (cap, torch.int32),
                                         (cap, torch.int32))))
        _row_select_kernel[(r,)](values, values.stride(0), n, lens if lens is not None else dummy, maxima,
                                 n_groups, glist, cval, cidx, out, K=k, NGP=_pow2(n_groups), G=g,
                                 BLOCK=max(whole or block, g), CAP=cap, BITS=bits, HAS_LEN=lens is not None,
                                 HAS_MAX=False, SEL=_select_code(select), WHOLE=bool(whole), **launch)
        return out
    maxima, counts = split_group_maxima(values, lens, n_groups, g, block, chunk)
    return select_from_maxima(values, k, lens, maxima, counts, cap=cap, block=block, bits=bits, rows_path=False,
                              select=select, **tune)
