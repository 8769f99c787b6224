"""The training forward (engine/train/batched.py) computes what the engine's forward computes.

Both run the small config's 40-layer plan on the same random weights: the engine one sequence at a
time with its caches, the trainer a batch of sequences at once with dense experts and chunked windows.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.config import load_config
from engine.model.engram import EngramLayout, ngram_rows
from engine.model.transformer import Model
from engine.run.probes import ProbeRequest
from engine.tokenizer import load_tokenizer
from engine.train.batched import BatchedForward, StepOptions
from engine.train.parts import engram_rows_batched, fp4_values, fp8_values
from engine.train.params import Trainee
from engine.checkpoint.weights import TensorWeights
from engine import quant

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(REPO / "assets" / "configs" / "small.json")
    tok = load_tokenizer(REPO / "assets" / "tokenizer" / "tokenizer.json")
    lookup, _ = tok.compressed_vocab()
    return cfg, tok, torch.tensor(lookup, dtype=torch.long)


def _engine_logits(cfg, tok, trainee, ids):
    model = Model(cfg, TensorWeights(trainee.export_tensors()), tok, act_quant=False)
    collect: dict = {}
    with torch.no_grad():
        logits = model.forward(ids, probes=ProbeRequest(kinds={"routing", "topk"}), collect=collect)
    return logits, collect


@pytest.mark.parametrize("topk", [64, 8])
def test_batched_forward_matches_engine(setup, topk):
    """T = 64 with the small config's k = 64 selects every visible entry; k = 8 (and a pool of two
    8-entry blocks at layer 20) exercises the gather path, the pool and the Reindex restriction."""
    cfg, tok, lookup = setup
    cfg = cfg.replace(index_topk=topk, candidate_topk_blocks=64 if topk == 64 else 2)
    torch.manual_seed(0)
    trainee = Trainee(cfg, "cpu", seed=3)
    for b in trainee.biases.values():
        b.uniform_(-0.05, 0.05)  # routing biases in play
    T = 64
    ids = torch.randint(5, cfg.vocab_size, (2, T))
    fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup)
    with torch.no_grad():
        out = fwd(ids, StepOptions(analysis=True, position_ties=True))
    loads = torch.zeros(cfg.n_layers, cfg.n_routed_experts)
    for b in range(2):
        ref, collect = _engine_logits(cfg, tok, trainee, ids[b])
        got = out.logits[b]
        # float32 sums in another order (which the CPU's SIMD width decides) flip a few FP8/FP4 cache
        # roundings, and a flip moves every later position a little: measured 6e-6 to 1e-2 relative L2
        # over the whole sequence across AVX2 / AVX-512 / scalar kernels, while the typical position
        # stays within ~1e-3 of the engine. A wrong mechanism is O(1) at most positions.
        per_position = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert float(per_position.median()) < 3e-3, per_position
        assert float((got - ref).norm() / ref.norm()) < 3e-2
        assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95
        for L in range(cfg.n_layers):
            loads[L] += torch.bincount(collect[L]["routing"]["experts"].flatten(), minlength=cfg.n_routed_experts)
    # routing: the same experts get the same tokens, up to a few near-tied flips
    assert float((loads - out.loads).abs().sum()) <= 0.02 * float(loads.sum())
    # the loads count each token's six experts once, per layer
    assert out.loads.shape == (cfg.n_layers, cfg.n_routed_experts)
    assert torch.all(out.loads.sum(-1) == 2 * T * cfg.n_activated_experts)
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert torch.allclose(out.loss_ce, ce)


def test_engram_rows_batched_matches_engine(setup):
    cfg, _, lookup = setup
    layout = EngramLayout.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 50))
    compressed = lookup[ids]
    for index in range(len(layout.layer_ids)):
        got = engram_rows_batched(layout, index, compressed)
        for b in range(3):
            assert torch.equal(got[b], ngram_rows(layout, index, compressed[b]))


def test_sync_free_formats_match_the_reference_quantizers():
    x = torch.randn(64, 128) * torch.logspace(-3, 2, 128)
    assert torch.equal(fp8_values(x, 32), quant.fp8_roundtrip(x, 32))
    assert torch.equal(fp4_values(x, 32, "e8m0"), quant.fp4_roundtrip(x, 32, "e8m0"))
    assert torch.equal(fp4_values(x, 16, "e4m3"), quant.fp4_roundtrip(x, 16, "e4m3"))


def test_indexer_learns_only_from_its_losses(setup):
    """V3.2 recipe: the cross-entropy gives the indexer no gradient, and the indexer's losses give
    the backbone none (its inputs are detached)."""
    cfg, _, lookup = setup
    trainee = Trainee(cfg, "cpu", seed=1)
    fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup)
    ids = torch.randint(5, cfg.vocab_size, (1, 64))
    out = fwd(ids, StepOptions(dense=True))
    idx_names = [n for n in trainee.params if ".indexer." in n and "wq_b" in n]
    grads = torch.autograd.grad(out.loss_ce, [trainee.params[n] for n in idx_names], allow_unused=True)
    assert all(g is None or float(g.abs().max()) == 0.0 for g in grads)
    out = fwd(ids, StepOptions(dense=True))
    backbone = trainee.params["layers.2.attn.wq_a.weight"]
    g, = torch.autograd.grad(out.loss_kl + out.loss_margin, [backbone], allow_unused=True)
    assert g is None or float(g.abs().max()) == 0.0
    g, = torch.autograd.grad(out.loss_kl, [trainee.params[idx_names[0]]])
    assert float(g.abs().max()) > 0


def test_focus_loss_against_a_hand_computation():
    """-log(share of the mass on the picks), averaged over the rows asked for, in float64 by hand."""
    from engine.train.parts import focus_loss

    torch.manual_seed(0)
    mass = torch.rand(2, 5, 7, dtype=torch.float64)
    mass[1, 4] = 0.0                                   # a row with no global mass is left out
    idx = torch.randint(0, 7, (2, 5, 3))
    idx[..., 1] = (idx[..., 0] + 1) % 7                # distinct picks in every row
    idx[..., 2] = (idx[..., 0] + 2) % 7
    valid = torch.ones(2, 5, 3, dtype=torch.bool)
    valid[0, 0, 2] = False                             # a padded pick does not count
    rows = torch.ones(2, 5, dtype=torch.bool)
    rows[0, 3] = False
    terms, shares = [], []
    for b in range(2):
        for t in range(5):
            total = float(mass[b, t].sum())
            if not rows[b, t] or total == 0:
                continue
            on = sum(float(mass[b, t, int(idx[b, t, j])]) for j in range(3) if valid[b, t, j])
            terms.append(-math.log(on / total))
            shares.append(on / total)
    loss, share = focus_loss(mass, idx, valid, rows)
    assert abs(float(loss) - sum(terms) / len(terms)) < 1e-6
    assert abs(float(share) - sum(shares) / len(shares)) < 1e-6


def test_focus_recall_equals_the_recall_probe(setup):
    """The dense step's own share on the top-k is the selection recall the analysis probe measures
    (layer 2, the first index layer, sees the same inputs in both forwards); the focus term trains
    the backbone's attention, never the indexer (its picks are constants)."""
    cfg, _, lookup = setup
    cfg = cfg.replace(index_topk=8, candidate_topk_blocks=4)
    trainee = Trainee(cfg, "cpu", seed=5)
    fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup)
    ids = torch.randint(5, cfg.vocab_size, (2, 128))
    with torch.no_grad():
        probe = fwd(ids, StepOptions(analysis=True))
    # the dense step runs with both limits lifted, as the training loop's dense forward
    dense_fwd = BatchedForward(cfg.replace(index_topk=1 << 20, candidate_topk_blocks=1 << 20), trainee.get,
                               EngramLayout.from_config(cfg), lookup, sparse_limits=(8, 4))
    out = dense_fwd(ids, StepOptions(dense=True, focus=True))
    assert abs(float(out.focus_recall[2]) - float(probe.recall[2]["recall"])) < 1e-5
    # every layer with a global branch attends the picks of its index source: all of them take part
    assert set(out.focus_recall) == {L for L in range(cfg.n_layers) if cfg.compress_ratios[L] > 0}
    assert all(0.0 < float(v) < 1.0 for v in out.focus_recall.values())
    backbone = [trainee.params[n] for n in ("layers.2.attn.wq_a.weight", "layers.2.attn.compressor.wkv.weight")]
    indexer = [trainee.params[n] for n in trainee.params if ".indexer." in n]
    grads = torch.autograd.grad(out.loss_focus, backbone + indexer, allow_unused=True)
    assert all(g is not None and float(g.abs().max()) > 0 for g in grads[: len(backbone)])
    assert all(g is None or float(g.abs().max()) == 0.0 for g in grads[len(backbone):])
    # a sparse step has no focus term (it sees only the picks)
    assert fwd(ids, StepOptions(focus=True)).loss_focus is None


def test_sequence_balance_loss_against_a_hand_computation():
    """sum_e f_e P_e per sequence (f: share of the sequence's slots x E, P: mean normalized affinity),
    averaged over sequences, in float64 by hand; 1 for a balanced sequence, E / k for a collapsed one."""
    from engine.train.parts import sequence_balance_loss

    torch.manual_seed(1)
    B, T, E, k = 3, 6, 5, 2
    scores = torch.rand(B, T, E, dtype=torch.float64) + 0.01
    experts = torch.stack([torch.randperm(E)[:k] for _ in range(B * T)]).view(B, T, k)
    per_seq = []
    for b in range(B):
        f = [sum(int(e in experts[b, t].tolist()) for t in range(T)) * E / (T * k) for e in range(E)]
        P = [sum(float(scores[b, t, e] / scores[b, t].sum()) for t in range(T)) / T for e in range(E)]
        per_seq.append(sum(fe * pe for fe, pe in zip(f, P)))
    assert abs(float(sequence_balance_loss(scores, experts)) - sum(per_seq) / B) < 1e-9
    # every token on the same k experts, which hold all the affinity: E / k
    collapsed = torch.zeros(1, T, E, dtype=torch.float64)
    collapsed[..., :k] = 1.0
    loss = sequence_balance_loss(collapsed, torch.arange(k).expand(1, T, k))
    assert abs(float(loss) - E / k) < 1e-12
    # uniform affinity and an even spread of the slots: 1
    even = torch.arange(T * k).view(1, T, k) % E
    assert abs(float(sequence_balance_loss(torch.ones(1, T, E, dtype=torch.float64), even)) - 1.0) < 1e-12


def test_seq_balance_trains_the_router_toward_each_sequence_spread(setup):
    """The balance term's gradient reaches the routers (and no indexer), and a few steps on it alone
    lower it: each sequence's tokens spread over more experts."""
    cfg, _, lookup = setup
    trainee = Trainee(cfg, "cpu", seed=2)
    fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup)
    ids = torch.randint(5, cfg.vocab_size, (2, 64))
    gates = [trainee.params[f"layers.{L}.ffn.gate.weight"] for L in (0, 39)]
    idx = trainee.params["layers.2.attn.indexer.wq_b.weight"]
    out = fwd(ids, StepOptions(seq_balance=True))
    assert out.loss_balance is not None
    g = torch.autograd.grad(out.loss_balance, gates + [idx], allow_unused=True)
    assert all(float(x.abs().max()) > 0 for x in g[:2])
    assert g[2] is None or float(g[2].abs().max()) == 0.0
    before = float(out.loss_balance.detach())
    opt = torch.optim.SGD(gates, lr=2.0)
    for _ in range(5):
        loss = fwd(ids, StepOptions(seq_balance=True)).loss_balance
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = float(fwd(ids, StepOptions(seq_balance=True)).loss_balance)
    assert after < before
    assert fwd(ids, StepOptions()).loss_balance is None


def test_bf16_step_follows_the_fp32_step(setup):
    """The bf16 paths (picked entries gathered once per index source in bf16, the indexer's KL dots in
    bf16) compute the same step as float32, to bf16's precision."""
    cfg, _, lookup = setup
    cfg = cfg.replace(index_topk=8, candidate_topk_blocks=2)
    trainee = Trainee(cfg, "cpu", seed=4)
    ids = torch.randint(5, cfg.vocab_size, (2, 64))
    outs = []
    for bf16 in (False, True):
        fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup, bf16=bf16)
        with torch.no_grad():
            outs.append(fwd(ids, StepOptions(analysis=True, position_ties=True)))
    ref, got = outs
    assert abs(float(got.loss_ce) - float(ref.loss_ce)) < 0.02 * float(ref.loss_ce)
    assert abs(float(got.loss_kl) - float(ref.loss_kl)) < 0.1 * float(ref.loss_kl) + 1e-3
    assert float((got.logits - ref.logits).norm() / ref.logits.norm()) < 0.1

