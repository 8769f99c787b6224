"""Top-k selection kept in position order, -1 padded.

`topk_positions_reference(values, k, lengths)` and `topk_positions_triton(...)` take scores
[R, L] float32 where -inf marks entries that may not be chosen, and return int32 [R, k]: the
positions of the min(k, #finite) largest scores, ascending, then -1. Ties at the threshold go to the
earliest positions.

The Triton version (three launches, one HBM read of the row for the bound, one for the filter):
  1. group maxima: the row is cut into ~`groups` groups of G entries; their maxima go to a small
     buffer (the indexer's scoring kernel writes these itself, so its logits are never re-read here).
  2. filter: the k-th largest group maximum t1 is a lower bound of the row's k-th largest value
     (k groups hold an entry >= t1), so every winner is >= t1; those candidates (about 1.15 k for
     2048 groups, whatever the row length) are appended, value and position, to a per-row buffer
     through one atomic counter per row.
  3. resolve: one program per row sorts the candidates' (ordered value key, inverted position) as one
     64-bit key, keeps the first k and sorts their positions. More than `cap` candidates (many exact
     ties, or fewer than k finite groups) fall back to the exact radix select over the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def topk_positions_reference(values: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """values [R, L] float -> int32 [R, k]; entries at or past lengths[r] count as -inf."""
    r, n = values.shape
    v = values.double().clone()
    if lengths is not None:
        v[torch.arange(n, device=v.device)[None, :] >= lengths.to(v.device).long()[:, None]] = float("-inf")
    out = torch.full((r, k), -1, dtype=torch.int32, device=values.device)
    # rank by (value desc, position asc): a stable sort on value gives the earliest positions at ties
    order = torch.sort(v, dim=1, descending=True, stable=True).indices
    for row in range(r):
        n_ok = min(k, int((v[row] > float("-inf")).sum()))
        chosen = torch.sort(order[row, :n_ok]).values
        out[row, :n_ok] = chosen.to(torch.int32)
    return out


@triton.jit
def _ordered_key(x):
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | (-2147483647 - 1)
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _pick_digit(hist, need, NB: tl.constexpr):
    """Largest digit d with #(digit >= d) >= need; returns (d, need - #(digit > d))."""
    bins = tl.arange(0, NB)
    total = tl.sum(hist, axis=0)
    suffix = total - tl.cumsum(hist, axis=0) + hist
    d = tl.max(tl.where(suffix >= need, bins, -1), axis=0)
    above = tl.sum(tl.where(bins == d, suffix - hist, 0), axis=0)
    return d, need - above


@triton.jit
def _radix_select_row(base, length, out_row, K: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Exact top-K positions of base[0:length] (-inf never chosen) -> out_row[0:K], ascending, -1 padded.
    32/BITS histogram passes find the K-th largest ordered key digit by digit; a last pass writes."""
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    n_valid = 0
    for start in range(0, length, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < length, other=neg_inf)
        n_valid += tl.sum((x > neg_inf).to(tl.int32), axis=0)
    take_all = n_valid <= K
    need = tl.maximum(tl.minimum(n_valid, K), 1)
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)
    prefix = tl.zeros([], dtype=tl.uint32)
    for p in tl.static_range(32 // BITS):
        hist = tl.zeros([NB], dtype=tl.int32)
        n_miss = 0
        if not take_all:
            for start in range(0, length, BLOCK):
                idx = start + offs
                x = tl.load(base + idx, mask=idx < length, other=neg_inf)
                key = _ordered_key(x)
                hit = x > neg_inf
                if p > 0:
                    hit = hit & ((key >> (32 - p * BITS)) == prefix)
                digit = ((key >> (32 - (p + 1) * BITS)) & (NB - 1)).to(tl.int32)
                hist += tl.histogram(tl.where(hit, digit, 0), NB)
                n_miss += BLOCK - tl.sum(hit.to(tl.int32), axis=0)
        hist -= tl.where(bins == 0, n_miss, 0)
        d, need = _pick_digit(hist, need, NB)
        prefix = (prefix << BITS) | tl.maximum(d, 0).to(tl.uint32)
    need_eq = need
    thr = prefix
    count = 0
    eq_seen = 0
    for start in range(0, length, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < length, other=neg_inf)
        valid = x > neg_inf
        key = _ordered_key(x)
        eq = valid & (key == thr)
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        sel = valid & (take_all | (key > thr) | (eq & (eq_rank < need_eq)))
        pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(out_row + pos, idx, mask=sel)
        count += tl.sum(sel.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)
    slots = tl.arange(0, K)
    tl.store(out_row + slots, tl.full([K], -1, tl.int32), mask=slots >= count)


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
def _filter_kernel(v_ptr, stride_v, n_cols, len_ptr, max_ptr, n_groups, chunk, cnt_ptr, cval_ptr, cidx_ptr,
                   K: tl.constexpr, NGP: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                   HAS_LEN: tl.constexpr, SORT: tl.constexpr):
    """t1 = the K-th largest group maximum of the row; entries >= t1 (finite) are appended to the row's
    candidate buffer (values, positions) at slots taken from its atomic counter."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    length = n_cols
    if HAS_LEN:
        length = tl.minimum(length, tl.load(len_ptr + row))
    gi = tl.arange(0, NGP)
    mx = tl.load(max_ptr + row.to(tl.int64) * n_groups + gi, mask=gi < n_groups, other=float("-inf"))
    if SORT:
        srt = tl.sort(mx, descending=True)
        t1 = tl.max(tl.where(gi == K - 1, srt, float("-inf")), axis=0)
    else:  # the interpreter's tl.sort is very slow: the K-th largest by counting, O(NGP^2)
        n_ge = tl.sum((mx[None, :] >= mx[:, None]).to(tl.int32), axis=1)
        t1 = tl.max(tl.where(n_ge >= K, mx, float("-inf")), axis=0)
    base = v_ptr + row.to(tl.int64) * stride_v
    offs = tl.arange(0, BLOCK)
    for start in range(c * chunk, tl.minimum(c * chunk + chunk, length), BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < length, other=float("-inf"))
        cand = (x >= t1) & (x > float("-inf"))
        n_c = tl.sum(cand.to(tl.int32), axis=0)
        if n_c > 0:
            slot0 = tl.atomic_add(cnt_ptr + row, n_c)
            slot = slot0 + tl.cumsum(cand.to(tl.int32), axis=0) - 1
            ok = cand & (slot < CAP)
            tl.store(cval_ptr + row.to(tl.int64) * CAP + slot, x, mask=ok)
            tl.store(cidx_ptr + row.to(tl.int64) * CAP + slot, idx, mask=ok)


@triton.jit
def _resolve_kernel(v_ptr, stride_v, n_cols, len_ptr, cnt_ptr, cval_ptr, cidx_ptr, out_ptr,
                    K: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                    HAS_LEN: tl.constexpr, SORT: tl.constexpr):
    """The exact top-K of the row's candidates (value desc, then position asc) in position order."""
    row = tl.program_id(0)
    n_cand = tl.load(cnt_ptr + row)
    out_row = out_ptr + row.to(tl.int64) * K
    if n_cand <= CAP:
        s = tl.arange(0, CAP)
        ok = s < n_cand
        x = tl.load(cval_ptr + row.to(tl.int64) * CAP + s, mask=ok, other=float("-inf"))
        p = tl.load(cidx_ptr + row.to(tl.int64) * CAP + s, mask=ok, other=0)
        inv = (p ^ -1).to(tl.uint32, bitcast=True).to(tl.uint64)
        key = tl.where(ok, (_ordered_key(x).to(tl.uint64) << 32) | inv, 0)
        slots = tl.arange(0, K)
        n_sel = tl.minimum(n_cand, K)
        if SORT:
            key = tl.sort(key, descending=True)
            first = tl.arange(0, CAP // K)[:, None] == 0
            top = tl.max(tl.where(first, tl.reshape(key, (CAP // K, K)), 0), axis=0)  # [K], best first
            pos = ((top & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32, bitcast=True)
            pos = tl.sort(tl.where(slots < n_sel, pos, 2147483647))
            tl.store(out_row + slots, tl.where(slots < n_sel, pos, -1))
        else:  # interpreter: ranks by counting (keys are distinct), O(CAP^2)
            rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), axis=1)
            sel = ok & (rank < K)
            slot = tl.sum(((p[None, :] < p[:, None]) & sel[None, :]).to(tl.int32), axis=1)
            tl.store(out_row + slot, p, mask=sel)
            tl.store(out_row + slots, tl.full([K], -1, tl.int32), mask=slots >= n_sel)
    else:
        length = n_cols
        if HAS_LEN:
            length = tl.minimum(length, tl.load(len_ptr + row))
        _radix_select_row(v_ptr + row.to(tl.int64) * stride_v, tl.maximum(length, 0), out_row, K, BLOCK, BITS)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def group_size(n: int, groups: int = 2048) -> int:
    """Entries per group-maximum for a row of n (a power of two, about `groups` groups)."""
    return _pow2(max(1, -(-n // groups)))


def _interpreted() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_from_maxima(values, k, lengths, maxima, counts, cap: int = 2048, block: int = 1024,
                       bits: int = 8, chunk: int | None = None, sort: bool | None = None) -> torch.Tensor:
    """Stages 2 and 3 on values [R, L] given maxima [R, n_groups] (group maxima, any group size) and
    counts int32 [R] already zeroed. -> int32 [R, k]. sort: tl.sort (the GPU's way) or, by default
    under the interpreter, counting ranks."""
    r, n = values.shape
    dev = values.device
    ngp = _pow2(maxima.shape[1])
    cap = max(min(_pow2(cap), _pow2(n)), k)  # a row never has more candidates than entries
    sort = not _interpreted() if sort is None else sort
    if not sort:  # counting ranks is O(n^2) in one tensor: keep it under Triton's 2^20 elements
        cap = min(cap, max(1024, k))
        if ngp > 1024:
            raise ValueError(f"counting ranks takes at most 1024 group maxima, got {ngp}")
    if chunk is None:  # enough programs to fill the machine, not so many that the maxima sort dominates
        per_row = max(1, min(n // 4096, -(-512 // r)))
        chunk = -(-n // per_row)
    chunk = -(-max(chunk, 1) // block) * block
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    lens = lengths if lengths is not None else dummy
    cval = torch.empty(r, cap, dtype=torch.float32, device=dev)
    cidx = torch.empty(r, cap, dtype=torch.int32, device=dev)
    _filter_kernel[(r, triton.cdiv(n, chunk))](values, values.stride(0), n, lens, maxima, maxima.shape[1],
                                               chunk, counts, cval, cidx, K=k, NGP=ngp, BLOCK=block, CAP=cap,
                                               HAS_LEN=lengths is not None, SORT=sort)
    out = torch.empty(r, k, dtype=torch.int32, device=dev)
    _resolve_kernel[(r,)](values, values.stride(0), n, lens, counts, cval, cidx, out, K=k, CAP=cap,
                          BLOCK=block, BITS=bits, HAS_LEN=lengths is not None, SORT=sort)
    return out


def topk_positions_triton(values: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
                          chunk: int | None = None, block: int = 1024, bits: int = 8,
                          cap: int = 2048, groups: int = 2048, sort: bool | None = None) -> torch.Tensor:
    """Triton twin of `topk_positions_reference`. values [R, L] float32 (row stride may exceed L).
    Knobs: block (entries per tile), cap (candidate buffer per row), groups (group maxima per row),
    chunk (entries per filter program), bits (the radix fallback's digit width)."""
    if values.dim() != 2 or values.dtype != torch.float32 or values.stride(1) != 1:
        raise ValueError("values must be a row-major float32 [R, L] tensor")
    if k & (k - 1):
        raise ValueError(f"k must be a power of two, got {k}")
    r, n = values.shape
    dev = values.device
    lens = lengths.to(device=dev, dtype=torch.int32).contiguous() if lengths is not None else None
    if sort is False or (sort is None and _interpreted()):
        groups = min(groups, 1024)
    groups = max(_pow2(groups), 2 * k)
    g = group_size(n, groups)
    block = max(block, g)
    n_groups = triton.cdiv(n, g)
    maxima = torch.empty(r, n_groups, dtype=torch.float32, device=dev)
    counts = torch.empty(r, dtype=torch.int32, device=dev)
    mchunk = block * max(1, triton.cdiv(n, block * max(1, triton.cdiv(512, r))))
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    _group_max_kernel[(r, triton.cdiv(n, mchunk))](values, values.stride(0), n, lens if lens is not None else dummy,
                                                   maxima, n_groups, counts, mchunk, G=g, BLOCK=block,
                                                   HAS_LEN=lens is not None)
    return select_from_maxima(values, k, lens, maxima, counts, cap=cap, block=block, bits=bits, chunk=chunk,
                              sort=sort)
