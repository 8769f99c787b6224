"""The probe format (engine/run/probes.py): a run's JSON read back with `from_json` gives the same
tensors (dtypes, shapes, -inf padding, NaN recall, the candidate pool's mask) and the same JSON."""

from __future__ import annotations

import json
import math

import torch

from engine.run.api import Engine
from engine.roles import FULL, REINDEX
from engine.run.probes import PROBE_KINDS, LayerResult, RunResult
from engine.checkpoint.weights import TensorWeights, random_weights
from tests.engine_helpers import IdentityTokenizer, random_ids, tiny_config


def _run(n_tokens: int = 24) -> RunResult:
    cfg = tiny_config()
    engine = Engine(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(cfg.engram_compressed_vocab_size),
                    threads=1)
    picking = [r.layer for r in engine.plan[: cfg.n_layers] if r.role in (FULL, REINDEX)]
    return engine.run(random_ids(cfg, n_tokens, seed=5).tolist(), probes=PROBE_KINDS, generate=2,
                      detail_layers=picking[:2], generated_probes=True)


def _same(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.isnan(), b.isnan()) if a.is_floating_point() else True, where
        keep = ~a.isnan() if a.is_floating_point() else torch.ones_like(a, dtype=torch.bool)
        assert torch.equal(a[keep], b[keep]), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def test_from_json_gives_back_every_probe_tensor():
    result = _run()
    text = json.dumps(result.to_json())  # through text, as a saved file
    back = RunResult.from_json(json.loads(text))
    assert back.layers.keys() == result.layers.keys() and back.generated_layers.keys() == result.generated_layers.keys()
    # the run holds what the format must carry: -inf score padding, NaN-free recall, ties, pools
    seen = {"inf": False, "pool": False, "recall": False, "tied": False}
    for part in ("layers", "generated_layers"):
        for L, layer in getattr(result, part).items():
            other = getattr(back, part)[L]
            for f in LayerResult.__dataclass_fields__:
                if f == "time_s":
                    assert math.isclose(getattr(other, f), getattr(layer, f))
                    continue
                _same(getattr(layer, f), getattr(other, f), f"{part}[{L}].{f}")
            if layer.topk_scores is not None and bool(torch.isinf(layer.topk_scores).any()):
                seen["inf"] = True
            seen["pool"] |= layer.candidate_pool is not None
            seen["recall"] |= layer.selection_recall is not None
            seen["tied"] |= layer.topk_tied is not None
    assert all(seen.values()), seen
    assert json.dumps(back.to_json()) == text
    for key in ("tokens", "token_ids", "generated_ids", "numerics", "prefill", "cache_bytes"):
        assert getattr(back, key) == getattr(result, key)


def test_from_json_reads_an_empty_pick_list_as_long():
    """The first queries of a layer that picks before any entry exists: [T, 0] picks stay integers."""
    d = {"layer": 2, "role": "Full", "label": "x", "compress_ratio": 2, "kv_source": 2, "index_source": 2,
         "window_size": 8, "topk": [[], []], "topk_scores": [[], []], "topk_kth": [None, None],
         "topk_tied": [[], []]}
    layer = LayerResult.from_json(d)
    assert layer.topk.dtype == torch.long and layer.topk.shape == (2, 0)
    assert layer.topk_tied.dtype == torch.bool and layer.topk_kth.tolist() == [float("-inf")] * 2


def test_a_run_stored_before_numerics_reads_back_as_fp32():
    """Run JSON written before the "numerics" field existed came from the fp32 flow (the only one then),
    whatever today's default is; a run that names its numerics keeps them."""
    stored = _run(n_tokens=8).to_json()
    assert stored["numerics"] == "reference"  # today's default, so the missing case is not a coincidence
    old = {k: v for k, v in stored.items() if k != "numerics"}
    assert RunResult.from_json(old).numerics == "fp32"
    assert RunResult.from_json({**old, "numerics": "reference"}).numerics == "reference"
