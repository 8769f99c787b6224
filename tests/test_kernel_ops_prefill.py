"""The kernel ops' prefill, where a host read stalls the GPU: TritonOps.index_topk settles the ties of all its
query blocks at once (one read of which rows tie, after every block's kernels are queued), and picks what the
block-by-block settling picks. On the tiny model, the kernels' references standing in for the kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.checkpoint.reader import CheckpointReader  # noqa: E402
from engine.checkpoint.weights import CheckpointWeights  # noqa: E402
from engine.model.transformer import Model  # noqa: E402
from engine.run.probes import ProbeRequest  # noqa: E402
from engine_helpers import IdentityTokenizer, random_ids, tiny_config, write_tiny_checkpoint  # noqa: E402


def test_ties_are_settled_once_for_every_query_block(tmp_path, monkeypatch):
    import engine.model.attention as A
    import engine.ops.triton as kernel_ops
    from engine.ops.reference import ReferenceOps

    monkeypatch.setattr(kernel_ops, "interpreter_active", lambda: False)
    cfg = tiny_config()
    weights = CheckpointWeights(CheckpointReader(write_tiny_checkpoint(tmp_path, seed=5, n_shards=1), cfg))
    ids = random_ids(cfg, 64, seed=4)
    calls = []
    real = ReferenceOps.break_ties
    monkeypatch.setattr(ReferenceOps, "break_ties", lambda self, *a: (calls.append(a[5].shape[0]), real(self, *a))[1])
    out, n_calls = {}, {}
    for block in (64, 16):  # one query block, then four
        monkeypatch.setattr(A, "QUERY_BLOCK", block)
        calls.clear()
        model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), numerics="reference",
                      kernels=True)
        collect = {}
        model.forward(ids, probes=ProbeRequest(kinds={"topk"}), collect=collect)
        out[block] = {L: (c["topk"], c.get("topk_tied")) for L, c in collect.items() if "topk" in c}
        assert calls and all(rows == 64 for rows in calls), calls  # every call sees all 64 queries' rows
        n_calls[block] = len(calls)
    assert n_calls[16] == n_calls[64]  # one a picking layer, however many blocks
    assert out[64].keys() == out[16].keys() and out[64]
    for layer in out[64]:
        assert torch.equal(out[64][layer][0], out[16][layer][0]), layer
        assert (out[64][layer][1] is None) == (out[16][layer][1] is None)
        if out[64][layer][1] is not None:
            assert torch.equal(out[64][layer][1], out[16][layer][1]), layer
