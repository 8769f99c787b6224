"""engine/ops: the reference's bf16 dtype flow against small hand-computed cases and a plain
sequential float64 walk of the reference's blocked attention; ties marked for what they are."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.attention import tie_marks, topk_in_position_order
from engine.ops import NUMERICS, NumericsError, ops_for
from engine.ops.reference import ATTN_BLOCK, to_bf16

REF, FP32 = ops_for("reference"), ops_for("fp32")


def test_names_and_default():
    assert NUMERICS == ("reference", "fp32")
    assert ops_for().name == "reference"
    with pytest.raises(NumericsError, match="unknown numerics 'bf17'"):
        ops_for("bf17")


def test_bf16_rounding_is_nearest_even_by_hand():
    # bf16 keeps 7 mantissa bits: steps of 2^-7 in [1, 2)
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-7, 1 + 2**-8 + 2**-20, -3.0])
    assert to_bf16(x).tolist() == [1.0, 1 + 2**-6, 1 + 2**-7, 1 + 2**-7, -3.0]
    assert REF.act(x).dtype == torch.float32
    assert torch.equal(FP32.act(x), x)


def test_rms_norm_stores_bf16():
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([1.0, 1.0 + 2**-9])
    # rms = sqrt(12.5): y = [3, 4] / 3.5355339 = [0.8485281, 1.1313709] (* w)
    exact = [3 / math.sqrt(12.5), 4 / math.sqrt(12.5) * (1 + 2**-9)]
    assert FP32.rms_norm(x, w, 0.0)[0].tolist() == pytest.approx(exact, rel=1e-6)
    got = REF.rms_norm(x, w, 0.0)[0].tolist()
    assert got == [float(torch.tensor(v).bfloat16()) for v in exact]
    assert got != pytest.approx(exact, rel=1e-6)


def test_index_scores_round_each_head_product_and_sum():
    # head 0: q.k = 1 + 2^-9 -> bf16 1.0, times weight 1 -> 1.0
    # head 1: q.k = 2^-8, times weight 1 -> 2^-8; the sum 1 + 2^-8 is halfway -> bf16 1.0 (even)
    q = torch.tensor([[[1.0, 2**-9], [2**-8, 0.0]]])       # [B=1, H=2, D=2]
    keys = torch.tensor([[1.0, 1.0], [1.0, -8.0]])         # [N=2, D]
    w = torch.tensor([[1.0, 1.0]])
    ref = REF.index_scores(q, keys, w)
    fp = FP32.index_scores(q, keys, w)
    assert ref[0, 0].item() == 1.0
    assert fp[0, 0].item() == pytest.approx(1 + 2**-9 + 2**-8, abs=0)
    # entry 1: head 0: 1 - 2^-6 (bf16 exact), head 1: 2^-8; relu keeps both; sum 1 - 2^-6 + 2^-8
    # = 0.98828125 -> bf16 steps of 2^-8 below 1: exact
    assert ref[0, 1].item() == 1 - 2**-6 + 2**-8
    # a negative head score is cut by relu before the weight
    assert REF.index_scores(q, -keys, w)[0].tolist() == [0.0, 0.0]


def test_attention_probabilities_rounded_to_bf16_by_hand():
    # one query, one head, two window slots with scores 0 and ln 3 (after the scale), no sink:
    # p = [exp(0 - ln 3), 1] = [1/3, 1]; bf16(1/3) = 0.333984375 in the numerator only
    D = 2
    scale = 1.0
    q = torch.tensor([[[1.0, 0.0]]])
    s = math.log(3.0)
    keys = torch.tensor([[0.0, 1.0], [s, 0.0]])            # slot scores 0 and ln 3
    windows = keys.t().unsqueeze(0)                        # [1, D, W=2]
    positions = torch.tensor([5])
    sink = torch.tensor([-math.inf])
    o, _ = REF.attend(q, positions, windows, sink, None, None, 2, scale)
    p0 = float(torch.tensor(1 / 3).bfloat16())
    assert p0 == 0.333984375
    p0_f32, p1 = math.exp(-s), 1.0
    expected = [(p0 * 0.0 + p1 * s) / (p0_f32 + p1), (p0 * 1.0 + p1 * 0.0) / (p0_f32 + p1)]
    assert o[0, 0].tolist() == [float(torch.tensor(v).bfloat16()) for v in expected]
    fp, _ = FP32.attend(q, positions, windows, sink, None, None, 2, scale)
    assert fp[0, 0].tolist() == pytest.approx([s * 0.75, 0.25], rel=1e-6)


def _sequential_reference(q, keys_per_query, valid, sink, scale):
    """The reference's online softmax written out as a plain loop in float64 (bf16 probabilities
    against the running max of each block of 64). q [H, D]; keys [C, D]; valid [C] bool."""
    H = q.shape[0]
    out = []
    for h in range(H):
        m, denom, acc = -1e30, 0.0, torch.zeros(q.shape[1], dtype=torch.float64)
        for a in range(0, keys_per_query.shape[0], ATTN_BLOCK):
            k, v = keys_per_query[a:a + ATTN_BLOCK].double(), valid[a:a + ATTN_BLOCK]
            s = (k @ q[h].double()) * scale
            s = torch.where(v, s, -math.inf)
            new_m = max(m, float(s.max()))
            p = torch.exp(s - new_m)
            rescale = math.exp(m - new_m)
            denom = denom * rescale + float(p.sum())
            pb = p.float().bfloat16().double()
            acc = acc * rescale + pb @ k
            m = new_m
        denom += math.exp(float(sink[h]) - m)
        out.append(acc / denom)
    return torch.stack(out)


@pytest.mark.parametrize("pos0", [0, 150])
def test_blocked_attention_matches_a_sequential_walk(pos0):
    g = torch.Generator().manual_seed(3)
    B, H, D, W, k = 6, 2, 16, 40, 50                      # W + k = 90 entries: two blocks of 64
    scale = D ** -0.5
    q = to_bf16(torch.randn(B, H, D, generator=g) * 2)
    n_keys = pos0 + B
    keys = to_bf16(torch.randn(n_keys, D, generator=g))
    global_kv = to_bf16(torch.randn(300, D, generator=g))
    rows = torch.stack([torch.randperm(300, generator=g)[:k].sort().values for _ in range(B)])
    padding = torch.zeros(B, k, dtype=torch.bool)
    padding[0, -7:] = True                                 # -1 picks at the end of a row
    positions = torch.arange(pos0, pos0 + B)
    pad = max(0, W - 1 - pos0)
    padded = torch.cat([keys.new_zeros(pad, D), keys]) if pad else keys
    windows = padded.unfold(0, W, 1)[pos0 + pad - (W - 1):pos0 + pad - (W - 1) + B]
    sink = torch.tensor([0.3, -1.0])
    o, probs = REF.attend(q, positions, windows, sink, (rows, padding), global_kv, W, scale, probs=True)
    same = []
    for b in range(B):
        t = int(positions[b])
        # the reference's column order: window slots valid first (oldest first), then the picks
        first = max(0, t - W + 1)
        win_keys = keys[first:t + 1]
        n_win = min(W, int(positions[-1]) + 1)              # a prompt shorter than W lists its length
        win_valid = torch.zeros(n_win, dtype=torch.bool)
        win_valid[:win_keys.shape[0]] = True
        win_all = torch.cat([win_keys, win_keys.new_zeros(n_win - win_keys.shape[0], D)])
        cols = torch.cat([win_all, global_kv[rows[b]]])
        valid = torch.cat([win_valid, ~padding[b]])
        expected = _sequential_reference(q[b], cols, valid, sink, scale)
        # fp32 vs float64 sums may move a value across a bf16 rounding boundary, rarely
        same.append((o[b] == to_bf16(expected.float())).float().mean().item())
        assert (o[b].double() - expected).abs().max() <= 2**-8 * expected.abs().max() + 1e-6
    assert min(same) > 0.97, same
    assert probs.shape == (B, H, k)
    assert (probs[0, :, -7:] == 0).all()


def test_reference_and_fp32_attention_agree_to_bf16_precision():
    g = torch.Generator().manual_seed(4)
    B, H, D, W = 8, 4, 32, 16
    q = to_bf16(torch.randn(B, H, D, generator=g))
    keys = to_bf16(torch.randn(W + B, D, generator=g))
    windows = keys.unfold(0, W, 1)[1:1 + B]
    positions = torch.arange(W, W + B)
    sink = torch.zeros(H)
    ref, _ = REF.attend(q, positions, windows, sink, None, None, W, D ** -0.5)
    fp, _ = FP32.attend(q, positions, windows, sink, None, None, W, D ** -0.5)
    assert not torch.equal(ref, fp)
    assert (ref - fp).norm() / fp.norm() < 1e-2


def test_tie_marks_by_hand():
    scores = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0],     # k=2: 3 and one of three 1s -> that pick ties
                           [3.0, 2.0, 1.0, 1.0, 0.0],     # no tie at the k-th score
                           [2.0, 2.0, 5.0, -math.inf, -math.inf]])  # 5 and one of two 2s
    idx, picked = topk_in_position_order(scores, 2)
    kth, tied = tie_marks(scores, idx, picked)
    assert idx.tolist() == [[0, 1], [0, 1], [0, 2]]
    assert kth.tolist() == [1.0, 2.0, 2.0]
    assert tied.tolist() == [[False, True], [False, False], [True, False]]
    idx, picked = topk_in_position_order(scores, 3)
    kth, tied = tie_marks(scores, idx, picked)
    assert kth.tolist() == [1.0, 1.0, 2.0]
    assert tied.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    # fewer finite entries than picks: padding, no k-th score, nothing tied
    short = torch.tensor([[1.0, -math.inf, -math.inf]])
    idx, picked = topk_in_position_order(short, 2)
    kth, tied = tie_marks(short, idx, picked)
    assert idx.tolist() == [[0, -1]] and kth.tolist() == [-math.inf] and tied.tolist() == [[False, False]]


@pytest.mark.parametrize("T", [1, 7, 300])
def test_reference_mhc_follows_the_reference_order_bit_for_bit(T):
    """The mixes, collapse and update against the reference's arithmetic written plainly (out of
    place, [T, i, j] layout, products summed over the copies with torch.sum): the same bits."""
    g = torch.Generator().manual_seed(T)
    hc, dim, iters, eps = 4, 64, 20, 1e-6
    x = to_bf16(torch.randn(T, hc, dim, generator=g))
    fn, scale, base = torch.randn(24, hc * dim, generator=g) * 0.05, torch.rand(3, generator=g), torch.randn(24, generator=g)
    pre, post, comb = REF.hc_mixes(x, fn, scale, base, hc, iters, eps, 1e-20)
    flat = x.flatten(1)
    m = torch.nn.functional.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-20)
    c = (m[:, 8:] * scale[2] + base[8:]).unflatten(-1, (hc, hc))
    c = torch.exp(c - c.amax(-1, keepdim=True))
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    assert torch.equal(comb, c)
    assert torch.equal(pre, torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps)
    y = to_bf16(torch.randn(T, dim, generator=g))
    expected = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * x.unsqueeze(-2), dim=1)
    assert torch.equal(REF.expand(y, x, post, comb), to_bf16(expected))
    assert torch.equal(REF.collapse(x, pre), to_bf16(torch.sum(pre.unsqueeze(-1) * x, dim=1)))
    # columns of comb sum to 1 (the last Sinkhorn step), rows nearly
    assert torch.allclose(comb.sum(-2), torch.ones(T, hc), atol=1e-5)


def test_reference_breaks_ties_as_torch_topk_over_the_full_row():
    # row 0: entries 1, 2, 3 tie at the k-th score; width 5 of n = 8 entries; visible 5
    scores = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.5], [4.0, 3.0, 2.0, 1.0, 0.0]])
    visible = torch.tensor([5, 4])
    idx, picked = topk_in_position_order(scores, 2)
    kth, tied = tie_marks(scores, idx, picked)
    assert tied[0].tolist() == [False, True] and not tied[1].any()
    got_idx, got_picked = REF.break_ties(scores, scores, visible, 8, 2, idx, picked, tied)
    full = torch.full((1, 8), -math.inf, dtype=torch.bfloat16)
    full[0, :5] = scores[0].bfloat16()
    expected = full.topk(2, sorted=False).indices.sort().values[0]
    assert got_idx[0].tolist() == expected.tolist() and got_idx[0, 0] == 0
    assert got_picked[0].tolist() == scores[0, expected].tolist()
    assert torch.equal(got_idx[1], idx[1])  # an untied row keeps its picks
    same = FP32.break_ties(scores, scores, visible, 8, 2, idx, picked, tied)
    assert same[0] is idx  # fp32: the lower-position rule stands
    # scores over the row's whole width (n = 5: narrowed, no -inf filled row): torch's top-k of that row
    whole = REF.break_ties(scores, scores, visible, 5, 2, idx, picked, tied)
    expected = scores[:1].bfloat16().topk(2, sorted=False).indices.sort().values[0]
    assert whole[0][0].tolist() == expected.tolist() and torch.equal(whole[0][1], idx[1])


def test_reference_pool_is_torch_topk_of_bf16_block_maxima():
    # 3 blocks of 2 over n = 6 entries; blocks 0 and 1 tie at 2.0 for the one slot left beside the
    # pinned newest block (2); torch's topk makes the choice, the rest follows the reference's rule
    scores = torch.tensor([[2.0, 1.0, 0.5, 2.0, 1.0, -math.inf]])
    visible = torch.tensor([5])
    keep = REF.select_blocks(scores, visible, 2, 2, 6)
    block_max = torch.tensor([[2.0, 2.0, math.inf]]).bfloat16()
    chosen = set(block_max.topk(2).indices[0].tolist())
    expected = torch.tensor([[b in chosen for b in (0, 0, 1, 1, 2, 2)]]) & (torch.arange(6) < 5)
    assert torch.equal(keep, expected)
    assert keep[0, 4] and not keep[0, 5]  # the newest visible block pinned; invisible entries out
    # fewer scores than entries (the padded route): the same pool
    assert torch.equal(REF.select_blocks(scores[:, :5], visible, 2, 2, 6), keep)
    # as many top blocks as blocks (or more): every block with a finite maximum, no top-k taken
    scores = torch.tensor([[2.0, 1.0, -math.inf, -math.inf, 1.0, 0.0, 3.0, 3.0]])
    for n_top in (4, 7):
        keep = REF.select_blocks(scores, torch.tensor([7]), n_top, 2, 8)
        assert keep[0].tolist() == [True, True, False, False, True, True, True, False]
