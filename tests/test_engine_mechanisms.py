"""Each mechanism of the forward against a plain float64 version written here (loops are fine)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model import mhc
from engine import quant
from engine.model.attention import Attention, LayerWeights, Shared, select_candidate_blocks
from engine.model.moe import route
from engine.ops.fp32 import Fp32Ops
from engine.roles import role_plan
from engine.model.rope import layer_freqs, rotate
from engine.checkpoint.weights import random_weights
from tests.engine_helpers import tiny_config


def sinkhorn_f64(logits, iters, eps):
    """Plain loops: row softmax + eps, divide columns, then (rows, columns) iters-1 times."""
    n = len(logits)
    c = [[0.0] * n for _ in range(n)]
    for i in range(n):
        mx = max(logits[i])
        ex = [math.exp(v - mx) for v in logits[i]]
        s = sum(ex)
        c[i] = [e / s + eps for e in ex]

    def cols():
        for j in range(n):
            s = sum(c[i][j] for i in range(n)) + eps
            for i in range(n):
                c[i][j] /= s

    def rows():
        for i in range(n):
            s = sum(c[i]) + eps
            c[i] = [v / s for v in c[i]]

    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return c


@pytest.mark.parametrize("spread", [0.5, 4.0])
def test_sinkhorn_matches_float64_loop(spread):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 4, 4, generator=g, dtype=torch.float64) * spread
    ours = mhc.sinkhorn(logits.float(), 20, 1e-6).double()
    for t in range(16):
        ref = torch.tensor(sinkhorn_f64(logits[t].tolist(), 20, 1e-6), dtype=torch.float64)
        assert torch.allclose(ours[t], ref, atol=1e-6), (t, (ours[t] - ref).abs().max())
    assert torch.allclose(ours.sum(dim=-2), torch.ones(16, 4, dtype=torch.float64), atol=1e-5)
    if spread > 2:  # 20 rounds end on columns: rows are only approximately normalized
        assert (ours.sum(dim=-1) - 1).abs().max() < 0.1


def test_hc_mixes_formulae():
    g = torch.Generator().manual_seed(2)
    hc, dim = 4, 32
    x = torch.randn(5, hc, dim, generator=g)
    fn = torch.randn(24, hc * dim, generator=g) * 0.1
    scale, base = torch.tensor([0.7, 1.3, 0.9]), torch.randn(24, generator=g)
    pre, post, comb = mhc.hc_mixes(x, fn, scale, base, hc, 20, 1e-6, 1e-20)
    xd = x.double().flatten(1)
    m = (xd @ fn.double().t()) / torch.sqrt(xd.square().mean(-1, keepdim=True))
    exp_pre = torch.sigmoid(m[:, :4] * 0.7 + base[:4].double()) + 1e-6
    exp_post = 2 * torch.sigmoid(m[:, 4:8] * 1.3 + base[4:8].double())
    assert torch.allclose(pre.double(), exp_pre, atol=1e-5)
    assert torch.allclose(post.double(), exp_post, atol=1e-5)
    for t in range(5):
        logits = (m[t, 8:] * 0.9 + base[8:].double()).view(4, 4).tolist()
        ref = torch.tensor(sinkhorn_f64(logits, 20, 1e-6), dtype=torch.float64)
        assert torch.allclose(comb[t].double(), ref, atol=1e-5)
    # the update: X'[j] = post[j] * y + sum_i comb[i, j] X[i]
    y = torch.randn(5, dim, generator=g)
    out = mhc.expand(y, x, post, comb)
    t, j = 3, 2
    manual = post[t, j] * y[t] + sum(comb[t, i, j] * x[t, i] for i in range(4))
    assert torch.allclose(out[t, j], manual, atol=1e-5)


def _attention(cfg, layer, seed=0):
    role = role_plan(cfg)[layer]
    w = random_weights(cfg, seed)
    get = w.__getitem__
    linear = lambda x, n, narrow=False: x.float() @ w[f"layers.{layer}.{n}.weight"].t()  # noqa: E731 (as Model.linear)
    return Attention(cfg, role, LayerWeights(get, f"layers.{layer}."), linear, Fp32Ops()), w


def test_m2_pooling_matches_float64_loop():
    cfg = tiny_config()
    attn, w = _attention(cfg, 2)
    g = torch.Generator().manual_seed(3)
    T = 7  # three complete pairs and one pending token
    x = torch.randn(T, cfg.dim, generator=g)
    attn.compressor.forward(x, torch.arange(T))
    p = "layers.2.attn.compressor."
    wkv, wgate, gain = (w[p + n].double() for n in ("wkv.weight", "wgate.weight", "norm.weight"))
    assert attn.source.n_entries == 3 and attn.source.pending_kv.shape[0] == 1
    for j in range(3):
        a, b = x[2 * j].double(), x[2 * j + 1].double()
        pooled = []
        for c in range(cfg.head_dim):
            sa, sb = (wgate[c] @ a).item(), (wgate[c] @ b).item()
            mx = max(sa, sb)
            ea, eb = math.exp(sa - mx), math.exp(sb - mx)
            pooled.append((ea * (wkv[c] @ a).item() + eb * (wkv[c] @ b).item()) / (ea + eb))
        v = torch.tensor(pooled, dtype=torch.float64)
        latent = v / torch.sqrt(v.square().mean() + cfg.norm_eps) * gain
        rotated = rotate(latent.float().unsqueeze(0), torch.tensor([2 * j]), layer_freqs(cfg, 2))[0].double()
        expected = quant.fp4_roundtrip(rotated.float().unsqueeze(0), 16, "e4m3")[0].double()
        assert torch.allclose(attn.source.kv_values[j].double(), expected, atol=1e-4), j
    # the pending token completes the next pair on the next call: same entry as a 2-token prefill
    x2 = torch.randn(1, cfg.dim, generator=g)
    attn.compressor.forward(x2, torch.tensor([T]))
    assert attn.source.n_entries == 4 and attn.source.pending_kv is None
    fresh, _ = _attention(cfg, 2)
    fresh.compressor.forward(torch.cat([x, x2]), torch.arange(T + 1))
    assert torch.allclose(fresh.source.kv_values, attn.source.kv_values, atol=1e-5)


def test_indexer_scores_topk_and_visibility():
    cfg = tiny_config(index_topk=4)
    attn, w = _attention(cfg, 2)
    g = torch.Generator().manual_seed(4)
    T = 16
    x = torch.randn(T, cfg.dim, generator=g)
    qr = torch.randn(T, cfg.q_lora_rank, generator=g)
    positions = torch.arange(T)
    attn.compressor.forward(x, positions)
    shared = Shared(source=attn.source)
    idx, picked = attn.indexer.forward(x, qr, positions, attn.source, shared)
    keys = attn.source.ik_values.double()
    p = "layers.2.attn.indexer."
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    q = (qr.double() @ w[p + "wq_b.weight"].double().t()).view(T, hi, di)
    q = rotate(q.float(), positions, attn.freqs)
    q = quant.fp4_roundtrip(q, 32, "e8m0").double()
    hw = (x.double() @ w[p + "weights_proj.weight"].double().t()) * di ** -0.5 * hi ** -0.5
    for t in range(T):
        visible = (t + 1) // 2  # entry j visible once t >= (j+1)*m - 1
        scores = []
        for j in range(keys.shape[0]):
            s = sum(hw[t, h].item() * max(0.0, (q[t, h] @ keys[j]).item()) for h in range(hi))
            scores.append(s if j < visible else -math.inf)
        k = min(4, keys.shape[0])
        order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:k]
        expected = sorted(j for j in order if scores[j] > -math.inf)
        got = [v for v in idx[t].tolist() if v >= 0]
        assert got == expected, (t, got, expected)
        assert all(j < visible for j in got)
        assert idx[t].tolist()[len(got):] == [-1] * (k - len(got))  # padding at the end, position order
        for j, s in zip(got, picked[t].tolist()):
            assert abs(s - scores[j]) < 1e-3 * max(1.0, abs(scores[j]))


def test_topk_in_position_order_with_ties_and_short_rows():
    from engine.model.attention import topk_in_position_order
    g = torch.Generator().manual_seed(9)
    T, N, k = 200, 50, 8
    # few distinct values (FP4 scores tie often), some rows with fewer than k finite entries
    scores = torch.randint(-3, 4, (T, N), generator=g).float() / 2
    scores[torch.rand(T, N, generator=g) < 0.2] = float("-inf")
    scores[:20, 5:] = float("-inf")
    scores[20:40] = torch.randn(20, N, generator=g)  # rows without ties take the sorted-picks path
    idx, picked = topk_in_position_order(scores, k)
    for t in range(T):
        row = scores[t].tolist()
        finite = [j for j in range(N) if row[j] > float("-inf")]
        best = sorted(finite, key=lambda j: (-row[j], j))[:k]  # ties to the lower position
        expected = sorted(best) + [-1] * (k - len(best))
        assert idx[t].tolist() == expected, t
        assert picked[t].tolist() == [row[j] for j in sorted(best)] + [float("-inf")] * (k - len(best))


@pytest.mark.parametrize("n,k", [(50, 8), (4096, 512), (300, 512), (40000, 64)])
def test_position_helpers_against_topk_and_sort(n, k):
    """compact_positions = the k smallest of where(mask, position, n) (rows with more than k chosen keep
    their first k); sorted_positions = an int64 sort, values and order, whatever narrow type it sorts in."""
    from engine.model.attention import compact_positions, sorted_positions
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(12, n, generator=g) < torch.rand(12, 1, generator=g)
    mask[0] = False
    pos = torch.where(mask, torch.arange(n), n)
    want = pos.topk(min(k, n), -1, largest=False, sorted=True).values
    got = compact_positions(mask, k)
    assert got.dtype == torch.long and got.shape == (12, k)
    assert torch.equal(got[:, :min(k, n)], want) and (got[:, n:] == n).all()
    idx = torch.stack([torch.randperm(n, generator=g)[:min(k, n)] for _ in range(12)])
    idx[:, 0] = -1  # the padding value sorts first
    values, order = sorted_positions(idx, n)
    want_values, want_order = idx.sort(-1)
    assert values.dtype == torch.long and torch.equal(values, want_values) and torch.equal(order, want_order)


def test_candidate_pool_blocks_and_restriction():
    g = torch.Generator().manual_seed(5)
    T, N, block = 6, 21, 4
    scores = torch.randn(T, N, generator=g)
    visible = torch.tensor([1, 5, 9, 14, 20, 21])
    scores = scores.masked_fill(torch.arange(N)[None] >= visible[:, None], float("-inf"))
    n_blocks = math.ceil(N / block)
    for n_top in (2, n_blocks, n_blocks + 3):  # the last two: every block a top block (no sort taken)
        keep = select_candidate_blocks(scores, visible, n_top, block)
        for t in range(T):
            best = [max(scores[t, b * block:(b + 1) * block].tolist()) for b in range(n_blocks)]
            newest = (visible[t].item() - 1) // block
            best[newest] = math.inf
            chosen = sorted(range(n_blocks), key=lambda b: (-best[b], b))[:n_top]
            chosen = [b for b in chosen if best[b] > -math.inf]
            expected = torch.zeros(N, dtype=torch.bool)
            for b in chosen:
                expected[b * block:(b + 1) * block] = True
            expected[visible[t]:] = False  # only the visible entries of a kept block
            assert torch.equal(keep[t], expected), (n_top, t)
    # a Reindex layer scores -inf outside the pool: its top-k lies inside the pool
    cfg = tiny_config(index_topk=8)
    from tests.engine_helpers import random_ids, tiny_model
    model = tiny_model(cfg)
    collect = {}
    from engine.run.probes import ProbeRequest
    with torch.inference_mode():
        model.forward(random_ids(cfg, 40), probes=ProbeRequest(layers={5, 7}), collect=collect)
    pool, top = collect[7]["candidate_pool"], collect[7]["topk"]
    assert torch.equal(collect[5]["candidate_pool"], pool)
    for t in range(40):
        sel = top[t][top[t] >= 0]
        assert pool[t, sel].all()
        assert pool[t].sum() <= cfg.candidate_topk_blocks * cfg.candidate_block_size


def test_routing_weights_sum_to_route_scale_with_distinct_experts():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(50, 32, generator=g)
    gate = torch.randn(384, 32, generator=g)
    bias, bias_vl = torch.randn(384, generator=g) * 0.1, torch.randn(384, generator=g)
    image = torch.zeros(50, dtype=torch.bool)
    image[20:30] = True
    scores, experts, weights = route(x, gate, bias, bias_vl, image, 6, 1.5)
    assert torch.allclose(weights.sum(-1), torch.full((50,), 1.5), atol=1e-5)
    assert all(len(set(row)) == 6 for row in experts.tolist())
    ref_scores = torch.sqrt(torch.log1p(torch.exp((x.double() @ gate.double().t()))))
    assert torch.allclose(scores.double(), ref_scores, atol=1e-4)
    for t in (0, 25):
        b = bias_vl if image[t] else bias
        expected = set((ref_scores[t] + b.double()).topk(6).indices.tolist())
        assert set(experts[t].tolist()) == expected
        w = ref_scores[t, experts[t]]
        assert torch.allclose(weights[t].double(), w / w.sum() * 1.5, atol=1e-5)


def test_fp4_and_fp8_against_value_tables():
    # E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; sign in bit 3; even index in the low nibble
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = quant.e2m1_codes(values)
    assert codes.tolist() == list(range(16))
    packed = quant.pack_fp4(codes)
    assert packed.view(torch.uint8).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(quant.unpack_fp4(packed), values)
    # a group whose amax is 6 has scale 1 (E8M0 byte 127); amax 12 gives scale 2 (byte 128)
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([6.0, -3.0, 1.2, 0.2])
    p, s = quant.quantize_fp4(x, 32, "e8m0")
    assert s.view(torch.uint8).tolist() == [[127]]
    assert quant.dequantize_fp4(p, s, 32)[0, :4].tolist() == [6.0, -3.0, 1.0, 0.0]
    p, s = quant.quantize_fp4(x * 2, 32, "e8m0")
    assert s.view(torch.uint8).tolist() == [[128]]
    # E4M3 scale for the KV: amax/6 rounded to E4M3 (amax 6 -> 1.0 = 0x38)
    p, s = quant.quantize_fp4(x[:, :16], 16, "e4m3")
    assert s.view(torch.uint8).tolist() == [[0x38]]
    # FP8 E4M3: 448 is the largest finite value (0x7E); scale rounds up to a power of two
    q, s = quant.quantize_fp8(torch.tensor([[448.0] + [1.0] * 31]), 32)
    assert s.view(torch.uint8).tolist() == [[127]] and q.view(torch.uint8)[0, 0].item() == 0x7E
    q, s = quant.quantize_fp8(torch.tensor([[449.0] + [0.0] * 31]), 32)
    assert s.float().item() == 2.0


def test_fast_rounding_is_bit_identical_to_the_byte_round_trip():
    g = torch.Generator().manual_seed(11)
    # every exponent an activation can have, exact E4M3 ties (odd multiples of half a step),
    # E4M3 subnormals (and their ties), zeros, and groups whose amax sits at the clamp 1e-4
    spread = torch.randn(4096, 32, generator=g) * torch.exp2(torch.randint(-40, 40, (4096, 1), generator=g).float())
    steps = torch.exp2(torch.randint(-9, 9, (512, 32), generator=g).float() - 3)
    ties = (torch.randint(1, 16, (512, 32), generator=g) * 2 + 1).float() * steps / 2
    ties[:, 0] = 448.0  # pins the scale at 1 so the ties land on the E4M3 grid
    tiny = torch.randint(-64, 64, (256, 32), generator=g).float() * 2.0**-11 * 1e-4 * 4
    x = torch.cat([spread, ties * torch.where(torch.rand(512, 32, generator=g) < 0.5, -1.0, 1.0), tiny,
                   torch.zeros(8, 32)])
    slow = quant.dequantize_fp8(*quant.quantize_fp8(x, 32), 32)
    assert torch.equal(quant.fp8_roundtrip(x, 32), slow)
    # out of the fast path's range: the byte round trip itself answers (inf, NaN, 2^120)
    odd = torch.tensor([[2.0**120] + [1.0] * 31, [float("inf")] + [1.0] * 31, [float("nan")] + [1.0] * 31])
    torch.testing.assert_close(quant.fp8_roundtrip(odd, 32), quant.dequantize_fp8(*quant.quantize_fp8(odd, 32), 32),
                               rtol=0, atol=0, equal_nan=True)
    # E2M1: every multiple of 1/64 in [-6, 6] (all ties included), random values, NaN -> code 0
    grid = torch.cat([torch.arange(-384, 385).float() / 64, (torch.rand(10000, generator=g) - 0.5) * 12,
                      torch.tensor([float("nan")])])
    assert torch.equal(quant.e2m1_codes(grid), quant.e2m1_codes_by_table(grid))


def test_rope_is_interleaved_pairs_on_the_tail():
    cfg = tiny_config()
    freqs = layer_freqs(cfg, 0)
    x = torch.randn(3, 2, cfg.head_dim)
    pos = torch.tensor([0, 5, 17])
    y = rotate(x, pos, freqs)
    rd = cfg.rope_head_dim
    assert torch.equal(y[..., :-rd], x[..., :-rd])
    t, i = 1, 3  # pair i of the tail: (x[2i], x[2i+1]) rotated by pos * freq_i
    a, b = x[t, 0, -rd + 2 * i].item(), x[t, 0, -rd + 2 * i + 1].item()
    ang = 5 * freqs[i].item()
    assert abs(y[t, 0, -rd + 2 * i].item() - (a * math.cos(ang) - b * math.sin(ang))) < 1e-5
    assert abs(y[t, 0, -rd + 2 * i + 1].item() - (a * math.sin(ang) + b * math.cos(ang))) < 1e-5
    assert torch.allclose(rotate(y, pos, freqs, inverse=True), x, atol=1e-5)


def test_sparse_attention_with_window_sinks_and_padding_matches_float64_loop():
    cfg = tiny_config()
    attn, w = _attention(cfg, 2)
    g = torch.Generator().manual_seed(7)
    B, H, D, W, N = 5, cfg.n_heads, cfg.head_dim, cfg.window_size, 12
    q = torch.randn(B, H, D, generator=g)
    keys = torch.randn(3 + B, D, generator=g)  # latents of positions 0..7; queries at positions 3..7
    positions = torch.arange(3, 3 + B)
    padded = torch.cat([torch.zeros(W - 1, D), keys])
    windows = padded.unfold(0, W, 1)[3:3 + B]  # query at p sees positions p-W+1..p
    sink = torch.randn(H, generator=g)
    global_kv = torch.randn(N, D, generator=g)
    idx = torch.tensor([[0, 3, -1, -1], [1, 2, 5, -1], [-1, -1, -1, -1], [0, 4, 7, 11], [2, 6, 9, -1]])
    scale = D ** -0.5
    out, _ = attn._attend(q * scale, positions, windows, sink, (idx.clamp_min(0), idx < 0), global_kv)
    for t in range(B):
        p = positions[t].item()
        entries = [keys[j].double() for j in range(max(0, p - W + 1), p + 1)]
        entries += [global_kv[j].double() for j in idx[t].tolist() if j >= 0]
        for h in range(H):
            logits = [float(q[t, h].double() @ e) * scale for e in entries]
            mx = max(logits + [sink[h].item()])
            weights = [math.exp(v - mx) for v in logits]
            denom = sum(weights) + math.exp(sink[h].item() - mx)
            expected = sum(wt * e for wt, e in zip(weights, entries)) / denom
            assert torch.allclose(out[t, h].double(), expected, atol=1e-5), (t, h)


def test_source_cache_appends_in_place_and_snapshots_keep_their_entries(monkeypatch):
    """SourceCache: entries appended one at a time equal the same entries appended at once (bytes and mirrors);
    the buffers grow by a factor (a few copies for many one-entry appends, not one a step); a snapshot keeps
    its entries while later ones are written after them; under autograd the mirrors stay differentiable."""
    from engine.model.attention import SourceCache
    g = torch.Generator().manual_seed(0)
    kv, ik = torch.randn(300, 64, generator=g), torch.randn(300, 32, generator=g)
    whole, one_by_one = SourceCache(1), SourceCache(1)
    with torch.no_grad():
        whole.append(kv, ik)
        grown, real_empty = [], torch.Tensor.new_empty
        monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: grown.append(1) or real_empty(self, *a, **k))
        snap = None
        for i in range(300):
            one_by_one.append(kv[i:i + 1], ik[i:i + 1])
            if i == 99:
                snap = one_by_one.snapshot()
        monkeypatch.undo()
    assert one_by_one.n_entries == whole.n_entries == 300 and snap.n_entries == 100
    for got, want in zip(one_by_one.packed(), whole.packed()):
        assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(one_by_one.kv_values, whole.kv_values) and torch.equal(one_by_one.ik_values, whole.ik_values)
    assert torch.equal(snap.kv_values, whole.kv_values[:100]) and snap.packed()[0].shape[0] == 100
    assert 6 * 6 <= len(grown) <= 6 * 12  # six buffers, each grown ~log_1.5(300 / 16) times
    assert one_by_one.global_nbytes() == whole.global_nbytes() == 300 * (32 + 4 + 16 + 1)
    x = kv[:8].clone().requires_grad_()
    trained = SourceCache(1)
    trained.append(x[:4], ik[:4])
    trained.append(x[4:], ik[4:])
    trained.kv_values.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))
