"""The k-th largest key searches the top-k kernels share (kernels/topk.py's rows path, kernels/topk_split.py's
split path): float32 scores as order-preserving uint32 keys, the k-th largest found by counting (2 bits a step) or by
histograms of digits, the candidates' bound over group maxima, and the exact radix select over a whole row (the
fallback where a row has more candidates than its buffer)."""

from __future__ import annotations

import triton
import triton.language as tl


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _select_code(select: str) -> int:
    codes = {"count": 0, "hist": 1}
    if select not in codes:
        raise ValueError(f"select must be 'count' or 'hist', got {select!r}")
    return codes[select]


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
def _kth_largest_key(key, valid, need):
    """The need-th largest (1 <= need <= #valid) of the uint32 keys where valid: two bits per step,
    each the largest digit keeping #(key >= prefix) >= need."""
    prefix = tl.zeros([], dtype=tl.uint32)
    for step in tl.static_range(16):
        unit = tl.full([], 1, tl.uint32) << (30 - 2 * step)
        c1 = prefix | unit
        c2 = prefix | (unit << 1)
        c3 = c1 | (unit << 1)
        n1 = tl.sum((valid & (key >= c1)).to(tl.int32), axis=0)
        n2 = tl.sum((valid & (key >= c2)).to(tl.int32), axis=0)
        n3 = tl.sum((valid & (key >= c3)).to(tl.int32), axis=0)
        prefix = tl.where(n3 >= need, c3, tl.where(n2 >= need, c2, tl.where(n1 >= need, c1, prefix)))
    return prefix


@triton.jit
def _kth_largest_key_hist(key, valid, need, BITS: tl.constexpr, STEPS: tl.constexpr = 0):
    """`_kth_largest_key` by histograms: ceil(32 / BITS) dependent steps (4 at 8 bits, not 16), each one
    tl.histogram of the next digit over the keys matching the prefix so far, then the largest digit keeping
    #(key >= prefix) >= need (as `_radix_select_row`'s passes, on a register tile). The first step takes the
    32 mod BITS top bits (or BITS), the others BITS each. A histogram costs ~log2(bins) ballots plus bins / 32
    popcounts an entry a warp (Triton's lowering), so 5-bit digits in 7 steps take ~2x fewer instructions than
    8-bit digits in 4, at more steps. STEPS > 0: only the first STEPS digits, the rest zero -- a lower bound
    of the key with at least `need` valid keys at or above it (the candidates' bound needs no more)."""
    NB: tl.constexpr = 1 << BITS
    NSTEP: tl.constexpr = (32 + BITS - 1) // BITS
    TAKE: tl.constexpr = NSTEP if STEPS == 0 or STEPS > NSTEP else STEPS
    prefix = tl.zeros([], dtype=tl.uint32)
    for p in tl.static_range(TAKE):
        lo = (NSTEP - 1 - p) * BITS  # the digit's lowest bit (a constant: p is)
        if p == 0:
            hit = valid
            digit = (key >> lo).to(tl.int32)
        else:
            hit = valid & ((key >> (lo + BITS)) == prefix)
            digit = ((key >> lo) & (NB - 1)).to(tl.int32)
        d, need = _pick_digit(tl.histogram(digit, NB, mask=hit), need, NB)
        prefix = (prefix << BITS) | tl.maximum(d, 0).to(tl.uint32)
    if TAKE < NSTEP:
        prefix = prefix << ((NSTEP - TAKE) * BITS)
    return prefix


@triton.jit
def _kth_key(key, valid, need, SEL: tl.constexpr, HBITS: tl.constexpr = 8, STEPS: tl.constexpr = 0):
    """The need-th largest valid key: SEL 0 by counting (2 bits a step), 1 by HBITS-bit histograms (STEPS > 0:
    its first STEPS digits, a lower bound)."""
    if SEL == 1:
        return _kth_largest_key_hist(key, valid, need, HBITS, STEPS)
    else:
        return _kth_largest_key(key, valid, need)


@triton.jit
def _candidate_bound(mx, K: tl.constexpr, SEL: tl.constexpr = 0, HBITS: tl.constexpr = 8, BSTEPS: tl.constexpr = 0):
    """Group maxima [NGP] -> the ordered key an entry must reach to be a candidate: the K-th largest
    finite maximum's key, or 0 (every finite entry) when fewer than K groups are finite. BSTEPS > 0 (histogram
    search): that key's first BSTEPS digits only, a lower bound -- any key at or under the K-th largest maximum
    keeps every winner a candidate (K groups reach it), at a few more candidates for fewer search steps."""
    fin = mx > float("-inf")
    n_fin = tl.sum(fin.to(tl.int32), axis=0)
    t1 = _kth_key(_ordered_key(mx), fin, tl.maximum(tl.minimum(n_fin, K), 1), SEL, HBITS, BSTEPS)
    return tl.where(n_fin >= K, t1, 0)
