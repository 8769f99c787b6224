"""The routed experts' grouped GEMMs with the decoded weights in shared memory (kernels/moe.py, `halves=True`).

kernels/moe.py's grouped GEMMs decode each FP4 weight tile into the wgmma's register A operand (swap-AB), which
on sm_90 (triton 3.6) goes through shared memory anyway (a store and an ldmatrix a fragment) and keeps each MMA
waiting on the registers it reads. Here the tokens are the MMA's M and the decoded weight tile its B operand,
so the tile is stored once in the MMA's shared layout and read by the tensor cores from there.

What keeps the decoded tile a plain 2-D tensor (triton 3.6 takes a decoded B operand only without joins): each
byte's two nibbles are decoded into two tiles (`e2m1_scaled_pairs`: low nibbles, high nibbles; the E8M0 scale
folded into the one bf16x2 multiply of a pair), and each goes into its own dot, against the activation's
columns of the same K. For that the activation (x of the gate/up GEMM, h of the down) is stored in HALVES order
inside each 32-group: position j holds K 2 j, position 16 + j holds K 2 j + 1 (`halves_order`); the round trip
of x writes it so (kernels/quant.py), and the gate/up kernel stores h so.

Numerics are kernels/moe.py's bf16 form's: the same exact products, float32 sums in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import moe_f8
from kernels._formats import e2m1_scaled_pairs


def halves_order(a: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K] with K in HALVES order inside each 32-group: position j holds index 2 j, 16 + j index
    2 j + 1."""
    r, kdim = a.shape
    return a.reshape(r, kdim // 32, 16, 2).transpose(-1, -2).reshape(r, kdim)


@triton.jit
def _halves_columns(BK: tl.constexpr):
    """A K step's activation columns (HALVES order) that meet its weight bytes' low nibbles, and their high
    nibbles': byte c of the step holds K 2 c and 2 c + 1, group c // 16."""
    c = tl.arange(0, BK // 2)
    lo = (c // 16) * 32 + c % 16
    return lo, lo + 16


@triton.jit
def _decoded_rows(row_ptr, srow_ptr, k0, BK: tl.constexpr, DT: tl.constexpr):
    """Rows of FP4 weights (row_ptr: each row's first byte, uint8 [BR] pointers; srow_ptr: its first E8M0 byte) over
    K k0 .. k0 + BK - 1 -> (even K, odd K) tiles [BR, BK/2] in DT: the E2M1 values times their scales (exact;
    scale bytes past 128 give inf or NaN, as the fold form: fp4_tiles.fold_fits)."""
    BR: tl.constexpr = row_ptr.shape[0]
    b = tl.load(row_ptr[:, None] + (k0 // 2 + tl.arange(0, BK // 2))[None, :])
    s = tl.load(srow_ptr[:, None] + (k0 // 32 + tl.arange(0, BK // 32))[None, :]).to(tl.int32)
    f = ((s + 126) << 23).to(tl.float32, bitcast=True).to(DT)  # 2^(s - 1): the placement leaves value * 2^-126
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BR, BK // 32, 16)), (BR, BK // 2))
    return e2m1_scaled_pairs(b, f, DT)


@triton.jit
def _decoded_halves(w_ptr, s_ptr, grow, k0, KDIM: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr):
    """Rows grow (int64) of an FP4 weight (uint8 [N, KDIM/2], E8M0 [N, KDIM/32]): `_decoded_rows`."""
    return _decoded_rows(w_ptr + grow * (KDIM // 2), s_ptr + grow * (KDIM // 32), k0, BK, DT)


@triton.jit
def _tile(bexp_ptr, bbeg_ptr, bend_ptr, order_ptr, NBM, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          GROUP_M: tl.constexpr):
    """This program's expert (< 0: none), its pairs' sorted rows (padding: the first again) with their mask and
    pair ids, and its N block's first row."""
    pid = tl.program_id(0)
    per_group = GROUP_M * (N // BN)  # GROUP_M token blocks sweep all N blocks together (kernels/moe.py)
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(NBM - first, GROUP_M)
    mb = first + (pid % per_group) % size
    e = tl.load(bexp_ptr + mb)
    begin = tl.load(bbeg_ptr + mb)
    rows = begin + tl.arange(0, BM)
    rmask = rows < tl.load(bend_ptr + mb)
    rows = tl.where(rmask, rows, begin)
    pair = tl.load(order_ptr + rows)
    return e, rows, rmask, pair, ((pid % per_group) // size) * BN


@triton.jit
def _gate_up_halves_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, h_ptr,
                           tw_ptr, limit, NBM, DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                           GROUP_M: tl.constexpr, FH: tl.constexpr, RB: tl.constexpr, PAIRED: tl.constexpr):
    e, rows, rmask, pair, n0 = _tile(bexp_ptr, bbeg_ptr, bend_ptr, order_ptr, NBM, INTER, BM, BN, GROUP_M)
    if e < 0:
        return
    grow = e.to(tl.int64) * INTER + n0 + tl.arange(0, BN)
    xrow = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * DIM
    col_lo, col_hi = _halves_columns(BK)
    if PAIRED:  # W1's and W3's rows interleaved in one tile: one decode and one dot a half, N = 2 BN
        r2 = tl.arange(0, 2 * BN)
        prow = tl.where(r2 % 2 == 0, w1_ptr, w3_ptr) + (e.to(tl.int64) * INTER + n0 + r2 // 2) * (DIM // 2)
        psrow = tl.where(r2 % 2 == 0, s1_ptr, s3_ptr) + (e.to(tl.int64) * INTER + n0 + r2 // 2) * (DIM // 32)
        acc = tl.zeros([BM, 2 * BN], tl.float32)
        for k0 in range(0, DIM, BK):
            x_lo = tl.load(xrow + (k0 + col_lo)[None, :]).to(DT)
            x_hi = tl.load(xrow + (k0 + col_hi)[None, :]).to(DT)
            lo, hi = _decoded_rows(prow, psrow, k0, BK, DT)
            acc = tl.dot(x_hi, tl.trans(hi), tl.dot(x_lo, tl.trans(lo), acc))
        acc1, acc3 = tl.split(tl.reshape(acc, (BM, BN, 2)))
    else:
        acc1 = tl.zeros([BM, BN], tl.float32)
        acc3 = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, DIM, BK):
            x_lo = tl.load(xrow + (k0 + col_lo)[None, :]).to(DT)
            x_hi = tl.load(xrow + (k0 + col_hi)[None, :]).to(DT)
            lo1, hi1 = _decoded_halves(w1_ptr, s1_ptr, grow, k0, DIM, BK, DT)
            lo3, hi3 = _decoded_halves(w3_ptr, s3_ptr, grow, k0, DIM, BK, DT)
            acc1 = tl.dot(x_hi, tl.trans(hi1), tl.dot(x_lo, tl.trans(lo1), acc1))
            acc3 = tl.dot(x_hi, tl.trans(hi3), tl.dot(x_lo, tl.trans(lo3), acc3))
    if FH:  # the engine's hidden state, w included (moe_f8's epilogue, on [rows of I, pairs])
        h = tl.trans(moe_f8.swiglu_e4m3_values(tl.trans(acc1), tl.trans(acc3),
                                               tl.load(tw_ptr + pair, mask=rmask, other=0.0), limit, BN, BM, RB))
    else:
        g = tl.minimum(acc1, limit)
        h = g / (1.0 + tl.exp(-g)) * tl.minimum(tl.maximum(acc3, -limit), limit)
    # stored in HALVES order along I, permuted in registers (on the store's addresses it costs narrow stores)
    h = tl.reshape(tl.permute(tl.reshape(h, (BM, BN // 32, 16, 2)), (0, 1, 3, 2)), (BM, BN))
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * INTER + (n0 + tl.arange(0, BN))[None, :],
             h.to(h_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _down_halves_kernel(h_ptr, w2_ptr, s2_ptr, order_ptr, bexp_ptr, bbeg_ptr, bend_ptr, tw_ptr, out_ptr, NBM,
                        DIM: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, GROUP_M: tl.constexpr,
                        FH: tl.constexpr, RB: tl.constexpr):
    e, rows, rmask, pair, n0 = _tile(bexp_ptr, bbeg_ptr, bend_ptr, order_ptr, NBM, DIM, BM, BN, GROUP_M)
    if e < 0:
        return
    n_idx = n0 + tl.arange(0, BN)
    grow = e.to(tl.int64) * DIM + n_idx
    hrow = h_ptr + rows.to(tl.int64)[:, None] * INTER
    col_lo, col_hi = _halves_columns(BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, INTER, BK):
        h_lo = tl.load(hrow + (k0 + col_lo)[None, :]).to(DT)
        h_hi = tl.load(hrow + (k0 + col_hi)[None, :]).to(DT)
        lo, hi = _decoded_halves(w2_ptr, s2_ptr, grow, k0, INTER, BK, DT)
        acc = tl.dot(h_hi, tl.trans(hi), tl.dot(h_lo, tl.trans(lo), acc))
    if FH:  # w is in h already; each expert's output as the numerics' act stores it
        y = moe_f8.act(acc, RB)
    else:
        y = acc * tl.load(tw_ptr + pair, mask=rmask, other=0.0)[:, None]
    tl.atomic_add(out_ptr + (pair // TOPK).to(tl.int64)[:, None] * DIM + n_idx[None, :], y, mask=rmask[:, None],
                  sem="relaxed")


def grouped_halves(xh, w1, s1, w3, s3, w2, s2, tw, order, tiles, h, out, limit: float, consts: dict,
                   launch: dict, paired: bool = False):
    """Both grouped GEMMs over the sorted pairs (kernels/moe.py moe_align) in each tile shape of `tiles`
    [((expert, begin, end) blocks, tokens a block, gate/up rows a tile, down rows a tile, gate/up launch options,
    down's)]: xh the activation in HALVES order, w* uint8 bytes, s* E8M0 bytes, h the hidden buffer [P, I]
    (written in HALVES order), out float32 [T, dim] (added to). paired: the gate/up kernel decodes W1's and W3's
    rows as one tile, interleaved (one dot a half, N twice the rows)."""
    dim, inter = consts["DIM"], consts["INTER"]
    for (bexp, bbeg, bend), bm, bn, _, cap, _ in tiles:
        nbm = bexp.numel()
        _gate_up_halves_kernel[(nbm * (inter // bn),)](xh, w1, s1, w3, s3, order, bexp, bbeg, bend, h, tw, limit,
                                                       nbm, BM=bm, BN=bn, PAIRED=paired, **consts, **launch, **cap)
    for (bexp, bbeg, bend), bm, _, bn, _, cap in tiles:
        nbm = bexp.numel()
        _down_halves_kernel[(nbm * (dim // bn),)](h, w2, s2, order, bexp, bbeg, bend, tw, out, nbm, BM=bm, BN=bn,
                                                  **consts, **launch, **cap)
    return out
