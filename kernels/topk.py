"""Top-k selection kept in position order, -1 padded (radix select on the float's ordered bits).

`topk_positions_reference(values, k, lengths)` and `topk_positions_triton(...)` take scores
[R, L] float32 where -inf marks entries that may not be chosen, and return int32 [R, k]: the
positions of the min(k, #finite) largest scores, ascending, then -1. Ties at the threshold go to the
earliest positions. The Triton version never sorts: 32/bits histogram passes over the
order-preserving integer key find the k-th largest key exactly; a last pass writes the winners.
Digit width `bits` (4, 8 or 16): the cost of Triton's histogram grows with the bin count.
Long rows are split into chunks whose winners are merged by a second launch.
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
        n_ok = int(torch.isfinite(v[row]).sum().clamp(max=k)) if True else 0
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
def _topk_kernel(v_ptr, stride_v, n_cols, len_ptr, n_chunks, chunk, src_ptr, stride_src,
                 out_idx_ptr, out_val_ptr, K: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_LEN: tl.constexpr, HAS_SRC: tl.constexpr, WRITE_VAL: tl.constexpr,
                 BITS: tl.constexpr = 8):
    pid = tl.program_id(0)
    row = pid // n_chunks
    c = pid % n_chunks
    col0 = c * chunk
    length = tl.minimum(n_cols - col0, chunk)
    if HAS_LEN:
        length = tl.minimum(length, tl.load(len_ptr + row) - col0)
    length = tl.maximum(length, 0)
    base = v_ptr + row.to(tl.int64) * stride_v + col0
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")

    # count finite entries
    n_valid = 0
    for start in range(0, length, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < length, other=neg_inf)
        n_valid += tl.sum((x > neg_inf).to(tl.int32), axis=0)
    take_all = n_valid <= K
    need = tl.maximum(tl.minimum(n_valid, K), 1)
    # radix passes, BITS bits each from the top: the k-th largest key, digit by digit
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

    # pass 4: write winners in position order
    out_row = out_idx_ptr + pid.to(tl.int64) * K
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
        if HAS_SRC:
            gidx = tl.load(src_ptr + row.to(tl.int64) * stride_src + col0 + idx, mask=sel, other=-1)
        else:
            gidx = col0 + idx
        tl.store(out_row + pos, gidx, mask=sel)
        if WRITE_VAL:
            tl.store(out_val_ptr + pid.to(tl.int64) * K + pos, x, mask=sel)
        count += tl.sum(sel.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)
    slots = tl.arange(0, K)
    tl.store(out_row + slots, tl.full([K], -1, tl.int32), mask=slots >= count)
    if WRITE_VAL:
        tl.store(out_val_ptr + pid.to(tl.int64) * K + slots, tl.full([K], neg_inf, tl.float32),
                 mask=slots >= count)


def topk_positions_triton(values: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
                          chunk: int | None = None, block: int = 1024,
                          bits: int = 8) -> torch.Tensor:
    """Triton twin of `topk_positions_reference`. values [R, L] float32 (row stride may exceed L)."""
    if values.dim() != 2 or values.dtype != torch.float32 or values.stride(1) != 1:
        raise ValueError("values must be a row-major float32 [R, L] tensor")
    if k & (k - 1):
        raise ValueError(f"k must be a power of two, got {k}")
    r, n = values.shape
    dev = values.device
    lens = lengths.to(device=dev, dtype=torch.int32).contiguous() if lengths is not None else None
    if chunk is None:
        chunk = 8192 if (r < 64 and n > 4 * 8192) else n
    chunk = max(chunk, k)
    n_chunks = triton.cdiv(n, chunk)
    dummy = torch.empty(1, dtype=torch.int32, device=dev)
    if n_chunks == 1:
        out = torch.empty(r, k, dtype=torch.int32, device=dev)
        _topk_kernel[(r,)](values, values.stride(0), n, lens if lens is not None else dummy, 1, n,
                           dummy, 0, out, dummy, K=k, BLOCK=block, HAS_LEN=lens is not None,
                           HAS_SRC=False, WRITE_VAL=False, BITS=bits)
        return out
    cand_idx = torch.empty(r * n_chunks, k, dtype=torch.int32, device=dev)
    cand_val = torch.empty(r * n_chunks, k, dtype=torch.float32, device=dev)
    _topk_kernel[(r * n_chunks,)](values, values.stride(0), n, lens if lens is not None else dummy,
                                  n_chunks, chunk, dummy, 0, cand_idx, cand_val, K=k, BLOCK=block,
                                  HAS_LEN=lens is not None, HAS_SRC=False, WRITE_VAL=True, BITS=bits)
    # the chunk winners are in position order already, so the merge keeps position order too
    cand_idx = cand_idx.view(r, n_chunks * k)
    cand_val = cand_val.view(r, n_chunks * k)
    out = torch.empty(r, k, dtype=torch.int32, device=dev)
    _topk_kernel[(r,)](cand_val, cand_val.stride(0), n_chunks * k, dummy, 1, n_chunks * k,
                       cand_idx, cand_idx.stride(0), out, dummy, K=k, BLOCK=block, HAS_LEN=False,
                       HAS_SRC=True, WRITE_VAL=False, BITS=bits)
    return out
