"""The trainer's picked-entry attention kernels (kernels/sparse_attn_train.py) on the CPU under
TRITON_INTERPRET=1: each kernel against a float64 gather-and-einsum reference (picks at -1 skipped,
sizes that are not powers of two), the two ops' gradients against float64 autograd of the gathered
form, and the trainer's attention core with the ops against its gathered form."""

import importlib
import os
import random

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by the kernels below

import pytest
import torch

import kernels.sparse_attn_train

importlib.reload(kernels.sparse_attn_train)  # re-create the jit functions if imported without the interpreter

from kernels import sparse_attn_train as sat  # noqa: E402


def _case(seed, B=2, T=5, H=4, D=32, N=7, K=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    entries = torch.randn(B, N, D, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, N, (B, T, K), generator=gen)
    idx[0, 1, K - 1] = -1        # a token with one pick missing
    idx[B - 1, T - 1] = -1       # a token with none
    w = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    return q, entries, idx, w


def _gathered(entries, idx):
    B = entries.shape[0]
    return entries[torch.arange(B)[:, None, None], idx.clamp_min(0)]          # [B, T, K, D]


def _reference_scores(q, entries, idx):
    return torch.einsum("bthd,btkd->bthk", q, _gathered(entries, idx)).masked_fill((idx < 0)[:, :, None, :], 0.0)


def _reference_combine(w, entries, idx):
    return torch.einsum("bthk,btkd->bthd", w.masked_fill((idx < 0)[:, :, None, :], 0.0), _gathered(entries, idx))


@pytest.mark.parametrize("shape", [dict(), dict(H=3, D=48, N=11, K=5), dict(B=1, T=9, H=1, D=16, N=4, K=4)])
def test_kernels_match_the_gathered_float64_forms(poisoned, shape):
    q, entries, idx, w = _case(random.randrange(2**31), **shape)
    N = entries.shape[1]
    got = sat.gather_scores(q.float(), entries.float(), idx)
    assert torch.allclose(got.double(), _reference_scores(q, entries, idx), atol=1e-5, rtol=1e-5)
    got = sat.gather_combine(w.float(), entries.float(), idx)
    assert torch.allclose(got.double(), _reference_combine(w, entries, idx), atol=1e-5, rtol=1e-5)
    # the scatter: each pick's sum_h w a added to the entry it came from (hand loop)
    want = torch.zeros(entries.shape, dtype=torch.float64)
    per_pick = torch.einsum("bthk,bthd->btkd", w, q)
    for b, t, j in torch.nonzero(idx >= 0).tolist():
        want[b, idx[b, t, j]] += per_pick[b, t, j]
    got = sat.scatter_picks(q.float(), w.float(), idx, N)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)


def test_ops_gradients_match_float64_autograd_of_the_gathered_form():
    q, entries, idx, w = _case(random.randrange(2**31))
    g_s = torch.randn(*idx.shape[:2], q.shape[2], idx.shape[2], dtype=torch.float64)
    g_o = torch.randn(q.shape, dtype=torch.float64)

    def loss(scores_fn, combine_fn, q_, e_, w_):
        return (scores_fn(q_, e_, idx) * g_s).sum() + (combine_fn(w_, e_, idx) * g_o).sum()

    leaves = [t.clone().requires_grad_(True) for t in (q, entries, w)]
    want = torch.autograd.grad(loss(_reference_scores, _reference_combine, *leaves), leaves)
    leaves32 = [t.float().requires_grad_(True) for t in (q, entries, w)]
    got = torch.autograd.grad(loss(sat.picked_scores, sat.picked_combine, *leaves32), leaves32)
    for name, a, b in zip(("q", "entries", "w"), want, got):
        assert b.dtype == torch.float32
        assert torch.allclose(b.double(), a, atol=1e-5, rtol=1e-5), name
    # bf16 inputs: the gradients come back in bf16, computed in float32
    qb, eb = q.bfloat16().requires_grad_(True), entries.bfloat16().requires_grad_(True)
    dq, de = torch.autograd.grad((sat.picked_scores(qb, eb, idx) * g_s.float()).sum(), (qb, eb))
    assert dq.dtype == de.dtype == torch.bfloat16


def test_shapes_are_checked():
    q, entries, idx, w = _case(1)
    with pytest.raises(ValueError, match="shapes disagree"):
        sat.gather_scores(q.float(), entries[:, :, :16].float(), idx)
    with pytest.raises(ValueError, match=r"a \[B, T, H, D\]"):
        sat.gather_scores(q[0].float(), entries.float(), idx)
    with pytest.raises(ValueError, match="disagree"):
        sat.gather_combine(w[..., :2].float(), entries.float(), idx)


def test_trainer_attention_core_with_the_ops_matches_its_gathered_form():
    """engine/train/batched.py's attention core: picks attended through the ops (entries [B, N, D] and
    idx) against the gathered [B, T, k, D] form, forward and gradients (float32, tiny config)."""
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
    sink = torch.randn(H, generator=gen)
    leaves = lambda: [t.clone().requires_grad_(True) for t in (q, kv, entries)]
    a = leaves()
    o1, p1 = fwd._attend(a[0], a[1], (_gathered(a[2], idx), False, valid), sink)
    b = leaves()
    o2, p2 = fwd._attend(b[0], b[1], ((b[2], idx), False, valid), sink)
    assert torch.allclose(o1, o2, atol=1e-5) and torch.allclose(p1, p2, atol=1e-6)
    g = torch.randn(o1.shape, generator=gen)
    for x, y in zip(torch.autograd.grad((o1 * g).sum() + p1.sum(), a), torch.autograd.grad((o2 * g).sum() + p2.sum(), b)):
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
