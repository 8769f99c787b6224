"""The trainer's picked-entry attention kernels (kernels/sparse_attn_train.py) on the CPU under
TRITON_INTERPRET=1: the attention and the scores against float64 gather-and-einsum references (picks at
-1 skipped, a token with none, sizes that are not powers of two), their gradients against float64
autograd of the gathered forms, the CSR pick index against a hand count, and the trainer's attention
core and whole step with the ops against their gathered forms."""

from interpreted import interpreted  # first: the interpreter before triton

import os
import random

import pytest
import torch

sat = interpreted("sparse_attn_train")


def _case(seed, B=2, T=5, H=4, D=32, N=7, K=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    entries = torch.randn(B, N, D, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, N, (B, T, K), generator=gen, dtype=torch.int32)
    idx[0, 1, K - 1] = -1        # a token with one pick missing
    idx[B - 1, T - 1] = -1       # a token with none
    return q, entries, idx


def _gathered(entries, idx):
    B = entries.shape[0]
    return entries[torch.arange(B)[:, None, None], idx.long().clamp_min(0)]   # [B, T, K, D]


def _reference_scores(q, entries, idx):
    return torch.einsum("bthd,btkd->bthk", q, _gathered(entries, idx)).masked_fill((idx < 0)[:, :, None, :], 0.0)


def _reference_attention(q, entries, idx):
    """(o, lse, s) of softmax attention over each token's picks, in q's dtype (float64)."""
    s = _reference_scores(q, entries, idx).masked_fill((idx < 0)[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return torch.einsum("bthk,btkd->bthd", p, _gathered(entries, idx)), lse, s


def _ops(q, entries, idx):
    return (q, entries, idx, *sat.pick_index(idx, entries.shape[1]))


SHAPES = [dict(), dict(H=3, D=16, N=11, K=5, T=7), dict(B=1, T=9, H=1, D=64, N=4, K=4)]


def test_pick_index_lists_each_entrys_picks_in_flat_order():
    _, entries, idx = _case(random.randrange(2**31), T=9, N=6, K=4)
    B, T, K = idx.shape
    N = entries.shape[1]
    order, starts = sat.pick_index(idx, N)
    assert order.dtype == starts.dtype == torch.int32 and int(starts[-1]) == int((idx >= 0).sum())
    flat = idx.flatten().tolist()
    for b in range(B):
        for n in range(N):
            e = b * N + n
            run = order[starts[e]: starts[e + 1]].tolist()
            want = [i for i, v in enumerate(flat) if v == n and i // (T * K) == b]
            assert run == want, (b, n)


@pytest.mark.parametrize("shape", SHAPES)
def test_attention_and_scores_match_the_gathered_float64_forms(shape):
    q, entries, idx = _case(random.randrange(2**31), **shape)
    o, lse, s = sat.picked_attention(*_ops(q.float(), entries.float(), idx))
    want_o, want_lse, want_s = _reference_attention(q, entries, idx)
    assert torch.allclose(o.double(), want_o, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and bool((lse[-1, -1] == float("-inf")).all())
    assert torch.allclose(lse.double().nan_to_num(neginf=0.0), want_lse.nan_to_num(neginf=0.0), atol=1e-5)
    assert torch.equal(torch.isinf(s), torch.isinf(want_s)) and bool((o[-1, -1] == 0).all())
    assert torch.allclose(s.double().nan_to_num(neginf=0.0), want_s.nan_to_num(neginf=0.0), atol=1e-5)
    got = sat.picked_scores(*_ops(q.float(), entries.float(), idx))
    assert torch.allclose(got.double(), _reference_scores(q, entries, idx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_gradients_match_float64_autograd_of_the_gathered_forms(shape):
    """The attention with both outputs in the loss (as the trainer merges o and lse with the window),
    and the scores: dq and the entries' gradient summed through the CSR index."""
    q, entries, idx = _case(random.randrange(2**31), **shape)
    gen = torch.Generator().manual_seed(5)
    B, T, H, D = q.shape
    g_o, g_l = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), torch.randn(B, T, H, generator=gen,
                                                                                        dtype=torch.float64)
    g_s = torch.randn(B, T, H, idx.shape[2], generator=gen, dtype=torch.float64)

    def attention_loss(o, lse, s):
        return (o * g_o).sum() + (lse.nan_to_num(neginf=0.0) * g_l).sum()

    ref_leaves = [q.clone().requires_grad_(True), entries.clone().requires_grad_(True)]
    got_leaves = [q.float().requires_grad_(True), entries.float().requires_grad_(True)]
    want = torch.autograd.grad(attention_loss(*_reference_attention(*ref_leaves, idx)), ref_leaves)
    got = torch.autograd.grad(attention_loss(*sat.picked_attention(*_ops(*got_leaves, idx))), got_leaves)
    for name, a, b in zip(("q", "entries"), want, got):
        assert b.dtype == torch.float32 and float(a.abs().max()) > 0
        assert torch.allclose(b.double(), a, atol=1e-5, rtol=1e-5), name
    want = torch.autograd.grad((_reference_scores(*ref_leaves, idx) * g_s).sum(), ref_leaves)
    got = torch.autograd.grad((sat.picked_scores(*_ops(*got_leaves, idx)) * g_s.float()).sum(), got_leaves)
    for name, a, b in zip(("a", "entries"), want, got):
        assert torch.allclose(b.double(), a, atol=1e-5, rtol=1e-5), name
    # bf16 inputs: the gradients come back in bf16
    qb, eb = q.bfloat16().requires_grad_(True), entries.bfloat16().requires_grad_(True)
    dq, de = torch.autograd.grad(sat.picked_attention(*_ops(qb, eb, idx))[0].sum(), (qb, eb))
    assert dq.dtype == de.dtype == torch.bfloat16


def test_shapes_are_checked():
    q, entries, idx = _case(1)
    with pytest.raises(ValueError, match="shapes disagree"):
        sat.picked_scores(*_ops(q.float(), entries[:, :, :16].float(), idx))
    with pytest.raises(ValueError, match="power of two"):
        sat.picked_attention(*_ops(q[..., :24].float(), entries[..., :24].float(), idx))
    with pytest.raises(ValueError, match=r"a \[B, T, H, D\]"):
        sat.picked_scores(q[0].float(), entries.float(), idx, *sat.pick_index(idx, entries.shape[1]))


def test_trainer_attention_core_with_the_ops_matches_its_gathered_form():
    """engine/train/batched.py's attention core: window and picks in one softmax, the picks attended
    through the op (their log-sum-exp merged with the window's) against the gathered [B, T, k, D] form,
    forward, attention mass on the picks and gradients (float32, tiny config)."""
    from engine.config import load_config
    from engine.train.batched import BatchedForward
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parent.parent / "assets" / "configs" / "small.json")
    fwd = BatchedForward(cfg, get=None, layout=None, compressed_lookup=None)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    B, T, H, D, N, K = 2, 2 * cfg.window_size, cfg.n_heads, cfg.head_dim, 20, 6
    q = torch.randn(B, T, H, D, generator=gen) * 0.2
    kv = torch.randn(B, T, D, generator=gen)
    entries = torch.randn(B, N, D, generator=gen)
    idx = torch.randint(0, N, (B, T, K), generator=gen)
    valid = torch.rand(B, T, K, generator=gen) > 0.2
    valid[1, 3] = False                                 # a token with no pick
    sink = torch.randn(H, generator=gen)
    leaves = lambda: [t.clone().requires_grad_(True) for t in (q, kv, entries)]
    a = leaves()
    o1, p1 = fwd._attend(a[0], a[1], (_gathered(a[2], idx), False, valid), sink)
    b = leaves()
    in_place = idx.masked_fill(~valid, -1).int()
    o2, p2 = fwd._attend(b[0], b[1], ((b[2], in_place, *sat.pick_index(in_place, N)), False, valid), sink)
    assert torch.allclose(o1, o2, atol=1e-5) and torch.allclose(p1.masked_fill(~valid[:, :, None], 0), p2, atol=1e-6)
    g = torch.randn(o1.shape, generator=gen)
    for x, y in zip(torch.autograd.grad((o1 * g).sum(), a), torch.autograd.grad((o2 * g).sum(), b)):
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)


def test_whole_training_forward_and_backward_with_the_ops():
    """The 40-layer trainer (small config, top-4 picks so that a short sequence picks): loss, indexer KL
    and gradients with the picks read in place against the gathered form's (float32, CPU). Not bit for
    bit: the kernels sum in another order, and a last-bit difference can flip a later layer's FP8 / FP4
    cache rounding; a plumbing error (a wrong pick, a missing term) moves these by orders more."""
    from pathlib import Path

    from engine.config import load_config
    from engine.model.engram import EngramLayout
    from engine.tokenizer import load_tokenizer
    from engine.train.batched import BatchedForward, StepOptions
    from engine.train.params import Trainee

    repo = Path(__file__).resolve().parent.parent
    cfg = load_config(repo / "assets" / "configs" / "small.json").replace(index_topk=4)
    lookup = torch.tensor(load_tokenizer(repo / "assets" / "tokenizer" / "tokenizer.json").compressed_vocab()[0])
    trainee = Trainee(cfg, "cpu", seed=3)
    ids = torch.randint(5, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(4))
    names = ["layers.3.attn.wq_b.weight", "layers.2.attn.compressor.wkv.weight", "layers.2.attn.indexer.wq_b.weight"]
    results = []
    for fused in (False, True):
        fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup, fused_picks=fused)
        out = fwd(ids, StepOptions(margin=0.1))
        grads = torch.autograd.grad(out.loss_ce + out.loss_kl, [trainee.params[n] for n in names])
        results.append((out.loss_ce.detach(), out.loss_kl.detach(), grads))
    (ce0, kl0, g0), (ce1, kl1, g1) = results
    # measured: ce 3e-5 apart, KL 2e-3 (a pick flipped somewhere shows most in the KL)
    assert abs(float(ce1 / ce0) - 1) < 3e-4 and float(kl0) > 0 and abs(float(kl1 / kl0) - 1) < 2e-2
    for name, a, b in zip(names, g0, g1):
        assert float(a.abs().max()) > 0, name
        cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
        assert cos > 0.995 and abs(float(b.norm() / a.norm()) - 1) < 2e-2, (name, cos)


def test_the_bench_smoke_runs_on_the_cpu(tmp_path):
    """benches/picked_attn.py end to end under the interpreter (tiny shapes, untimed): every row, and its
    parity column, where the kernels' float32 products (the interpreter's dot) match the float32
    gathered form and the bf16 gathered form does not."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "benches/picked_attn.py", "--device", "cpu", "--batch", "2", "--seq", "64",
                           "--picks", "8", "--out", str(tmp_path)], cwd=repo, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "picked-attn.json").read_text())
    assert [(r["m"], r["op"]) for r in report["rows"]] == [(m, op) for m in (2, 1)
                                                           for op in ("attention", "KL scores", "pick_index")]
    for p in report["parity"]:
        if p["form"] == "in place bf16":
            assert p["o"] < 1e-5, p
        else:
            assert p["o"] > 1e-4, p
    assert "| 2 | 32 | attention |" in (tmp_path / "picked-attn.md").read_text()
