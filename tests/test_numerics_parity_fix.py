"""engine/ops/reference.py computes its GEMMs as the official reference does, to the last bit: FP8/FP4
GEMMs sum K in blocks of 32 in order (hand-computed case where one fp32 sum would round otherwise),
the attention's rolled window keys give the same bits as keys gathered row-major per query."""

from __future__ import annotations

import torch

from engine.ops import ops_for
from engine.ops.reference import ATTN_BLOCK, GEMM_BLOCK_K, RUNNING_MAX_FLOOR, to_bf16

REF, FP32 = ops_for("reference"), ops_for("fp32")


def _fp32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).float())


def _blocked_by_hand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each block's products summed exactly (float64, the values are small powers of two), the block
    sums added to an fp32 accumulator one by one in K order, as the reference's CPU kernel."""
    M, K = x.shape
    out = torch.empty(M, w.shape[0])
    for m in range(M):
        for n in range(w.shape[0]):
            acc = 0.0
            for a in range(0, K, GEMM_BLOCK_K):
                block = sum(float(x[m, k]) * float(w[n, k]) for k in range(a, a + GEMM_BLOCK_K))
                acc = _fp32(acc + block)
            out[m, n] = acc
    return out


def test_fp8_gemm_sums_k_in_blocks_of_32_in_order_by_hand():
    # K = 96: three blocks. Row 0: block sums 2^24, 1, 1 -> in order 2^24 + 1 rounds to 2^24 (ties
    # to even: fp32's step at 2^24 is 2), again -> 2^24, while the exact sum 2^24 + 2 is an fp32 value.
    # Row 1: block sums 1, 1, 2^24 -> 2 + 2^24 exactly. Every value is FP8 E4M3 times a power of two.
    K = 3 * GEMM_BLOCK_K
    x = torch.zeros(2, K)
    w = torch.ones(1, K)
    x[0, 0], x[0, 32], x[0, 64] = 2.0 ** 24, 1.0, 1.0
    x[1, 0], x[1, 32], x[1, 64] = 1.0, 1.0, 2.0 ** 24
    w[0, 0] = w[0, 32] = w[0, 64] = 1.0
    got = REF.gemm(x, w)
    expected = _blocked_by_hand(x, w)
    assert expected[:, 0].tolist() == [2.0 ** 24, 2.0 ** 24 + 2]
    assert got.tolist() == expected.tolist()
    exact = (x.double() @ w.double().t()).float()
    assert exact[0, 0].item() == 2.0 ** 24 + 2  # a correctly rounded single sum differs in the last bit
    assert got[0, 0].item() != exact[0, 0].item()


def test_fp8_gemm_blocked_matches_the_loop_on_random_quantized_operands():
    # small-integer E4M3 values: every block's sum is exact in fp32 whatever the kernel's order, so the
    # only roundings are the adds of the block partials (scales 2^0..2^22 apart), done here by loop
    g = torch.Generator().manual_seed(0)
    M, N, K = 37, 24, 8 * GEMM_BLOCK_K
    scale_x = 2.0 ** torch.randint(0, 12, (M, K // 32), generator=g).float().repeat_interleave(32, 1)
    scale_w = 2.0 ** torch.randint(0, 11, (N, K // 32), generator=g).float().repeat_interleave(32, 1)
    x = torch.randint(-8, 9, (M, K), generator=g).float() * scale_x
    w = torch.randint(-4, 5, (N, K), generator=g).float() * scale_w
    expected = torch.zeros(M, N)
    for a in range(0, K, GEMM_BLOCK_K):
        expected += (x[:, a:a + 32].double() @ w[:, a:a + 32].double().t()).float()  # exact partials
    got = REF.gemm(x, w)
    assert torch.equal(got, expected)
    exact = (x.double() @ w.double().t()).float()
    assert (got != exact).any()  # the case does exercise the order of the adds
    assert torch.equal(FP32.gemm(x, w), x @ w.t())  # fp32 numerics keep the one GEMM


def _attention_rows_gathered(q, keys, positions, W, scale, sink):
    """The reference's sparse attention for window-only queries: each query's keys gathered row-major
    [B, n, D] (valid slots oldest first, empty ones zero), blocks of 64, bf16 probabilities."""
    B, H, D = q.shape
    n = min(W, int(positions[-1]) + 1)
    rows = torch.zeros(B, n, D)
    valid = torch.zeros(B, n, dtype=torch.bool)
    for b, t in enumerate(positions.tolist()):
        first = max(0, t - W + 1)
        rows[b, :t + 1 - first] = keys[first:t + 1]
        valid[b, :t + 1 - first] = True
    running = torch.full((B, H), RUNNING_MAX_FLOOR)
    acc, denom = torch.zeros(B, H, D), torch.zeros(B, H)
    for a in range(0, n, ATTN_BLOCK):
        kb = rows[:, a:a + ATTN_BLOCK].contiguous()
        s = torch.where(valid[:, None, a:a + ATTN_BLOCK], torch.bmm(q, kb.transpose(1, 2)), float("-inf")) * scale
        new = torch.maximum(running, s.amax(-1))
        rescale = torch.exp(running - new)
        p = torch.exp(s - new.unsqueeze(-1))
        denom = denom * rescale + p.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + torch.bmm(to_bf16(p), kb)
        running = new
    denom = denom + torch.exp(sink.view(1, -1) - running)
    return to_bf16(acc / denom.unsqueeze(-1))


def test_early_queries_attend_with_row_major_keys_bit_for_bit():
    # the first queries' rolled windows (positions < W - 1) must give the reference's bits
    g = torch.Generator().manual_seed(5)
    B, H, D, W = 40, 4, 128, 32
    q = to_bf16(torch.randn(B, H, D, generator=g))
    keys = to_bf16(torch.randn(B, D, generator=g))
    positions = torch.arange(B)
    padded = torch.cat([keys.new_zeros(W - 1, D), keys])
    windows = padded.unfold(0, W, 1)[:B]  # [B, D, W], as engine/ops/fp32.py sparse_attention builds it
    sink = torch.linspace(-1, 1, H)
    o, _ = REF.attend(q, positions, windows, sink, None, None, W, D ** -0.5)
    assert torch.equal(o, _attention_rows_gathered(q, keys, positions, W, D ** -0.5, sink))
