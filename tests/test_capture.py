"""The capture-safe forms (engine/capture.py): what a CUDA graph's capture takes instead of branching on
device values must give the same values as the branching forms, row for row. Checked on the CPU by
forcing the branch-free forms (`branch_free()`): single top-k rows with ties, the reference numerics'
tie breaking, and whole prompts through the tiny model on the kernel ops (picks, tie marks, Reindex
pool top-ups, logits), bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import quant  # noqa: E402
from engine.capture import branch_free, capturing  # noqa: E402
from engine.model.attention import NEG_INF, topk_in_position_order  # noqa: E402
from engine.model.transformer import Model  # noqa: E402
from engine.checkpoint.reader import CheckpointReader  # noqa: E402
from engine.checkpoint.weights import CheckpointWeights  # noqa: E402
from engine.ops.reference import ReferenceOps  # noqa: E402
from engine_helpers import IdentityTokenizer, random_ids, tiny_config, write_tiny_checkpoint  # noqa: E402


def test_branch_free_is_scoped():
    assert not capturing()
    with branch_free():
        assert capturing()
        with branch_free():
            assert capturing()
        assert capturing()
    assert not capturing()


def tied_scores() -> torch.Tensor:
    """Rows that exercise both forms: all distinct, ties at the k-th value, fewer finite entries
    than k, a whole row of one value, and -inf gaps."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(40, generator=g),
            torch.randint(0, 4, (40,), generator=g).float(),
            torch.where(torch.arange(40) < 5, torch.randn(40, generator=g), torch.tensor(NEG_INF)),
            torch.zeros(40),
            torch.where(torch.arange(40) % 3 == 0, torch.tensor(NEG_INF), torch.randint(0, 3, (40,), generator=g).float())]
    return torch.stack(rows)


def test_topk_in_position_order_branch_free_matches():
    scores = tied_scores()
    idx, picked = topk_in_position_order(scores, 8)
    with branch_free():
        idx_bf, picked_bf = topk_in_position_order(scores, 8)
    assert torch.equal(idx, idx_bf) and torch.equal(picked, picked_bf)
    # the tie rows really took the tie-aware path: lowest positions among the k-th value's holders
    assert idx[3].tolist() == list(range(8))
    assert idx[2, 5:].tolist() == [-1, -1, -1]


def test_break_ties_branch_free_matches():
    scores = tied_scores()
    k, n = 8, scores.shape[1]
    visible = torch.tensor([40, 40, 40, 30, 40])
    idx, picked = topk_in_position_order(scores, k)
    tied = torch.zeros_like(idx, dtype=torch.bool)
    tied[1, :3] = True  # rows 1 and 3 re-picked, the others kept
    tied[3, 0] = True
    ops = ReferenceOps.__new__(ReferenceOps)
    got = ops.break_ties(scores, scores, visible, n, k, idx, picked, tied)
    with branch_free():
        got_bf = ops.break_ties(scores, scores, visible, n, k, idx, picked, tied)
    assert torch.equal(got[0], got_bf[0]) and torch.equal(got[1], got_bf[1])
    assert torch.equal(got[0][[0, 2, 4]], idx[[0, 2, 4]])  # untied rows keep their picks
    assert (got[0][3] < 30).all()  # a re-picked row sees only its visible entries


def test_fp8_roundtrip_finite_input_same_either_way():
    x = torch.randn(6, 64) * torch.logspace(-8, 8, 6)[:, None]
    with branch_free():
        fast = quant.fp8_roundtrip(x, 32)
    assert torch.equal(fast, quant.fp8_roundtrip(x, 32))
    assert torch.equal(fast, quant.dequantize_fp8(*quant.quantize_fp8(x, 32), 32))


def run_prompt(model: Model, ids: torch.Tensor, chunks: list[int]):
    """Logits of each chunk and every layer's picks and tie marks after it."""
    model.reset()
    out, start = [], 0
    for size in chunks:
        logits = model.forward(ids[start:start + size])
        start += size
        picks = [(b.attn.indexer.last_topk.clone(), *(t.clone() for t in b.attn.indexer.ties))
                 for b in model.blocks if getattr(b.attn, "indexer", None) is not None]
        out.append((logits, picks))
    return out


def test_tiny_model_branch_free_bit_for_bit(tmp_path, monkeypatch):
    """A 40-token prompt as a prefill of 33 and 7 one-token steps, on the kernel ops (their references on
    the CPU) with the reference numerics: every logit, pick and tie mark the same with the branch-free
    forms, on a prompt whose top-ks do tie (so the forms were both exercised)."""
    import engine.ops.triton as kernel_ops
    monkeypatch.setattr(kernel_ops, "interpreter_active", lambda: False)  # the kernels' references, whichever
    # test module switched the interpreter on before (the kernels' own tests run them interpreted)
    cfg = tiny_config()
    weights = CheckpointWeights(CheckpointReader(write_tiny_checkpoint(tmp_path, seed=5, n_shards=1), cfg))
    model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), numerics="reference", kernels=True)
    ids = random_ids(cfg, 40, seed=2)
    chunks = [33] + [1] * 7
    plain = run_prompt(model, ids, chunks)
    with branch_free():
        forced = run_prompt(model, ids, chunks)
    ties_seen = 0
    for (logits, picks), (logits_bf, picks_bf) in zip(plain, forced):
        assert torch.equal(logits, logits_bf)
        for a, b in zip(picks, picks_bf):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
            ties_seen += int(a[2].any())
    assert ties_seen > 0
