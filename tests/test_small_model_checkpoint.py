"""The shipped small model (assets/model): size, layout, and that it learned something measurable.

One forward over a held-out slice (first 1024 tokens of assets/corpus/heldout_sample.txt) feeds the
loss, expert-load and indexer tests, so the file stays fast on 2 cores.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.run.api import DEFAULT_CHECKPOINT, load
from engine.config import load_config
from engine.train.eval import unigram_loss, windows
from engine.checkpoint.layout import tensor_specs
from engine.run.probes import ProbeRequest
from engine.roles import FULL, REINDEX, role_plan

REPO = Path(__file__).resolve().parent.parent
SLICE = 1024
MAX_BYTES = 48_000_000


@pytest.fixture(scope="module")
def engine():
    return load()


@pytest.fixture(scope="module")
def slice_run(engine):
    text = (REPO / "assets" / "corpus" / "heldout_sample.txt").read_text(encoding="utf-8")
    ids = engine.tokenizer.encode(text, add_bos=True)[:SLICE]
    collect: dict = {}
    with torch.inference_mode():
        engine.model.reset()
        logits = engine.model.forward(torch.tensor(ids), probes=ProbeRequest(kinds={"topk", "routing"}),
                                      collect=collect)
        engine.model.reset()
    loss = F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item()
    return ids, loss, collect


def test_checkpoint_size_and_layout():
    files = [f for f in DEFAULT_CHECKPOINT.iterdir() if f.suffix in (".safetensors", ".json")
             and f.name not in ("tokenizer.json", "compressed_vocab.json")]
    total = sum(f.stat().st_size for f in files)
    assert total <= MAX_BYTES
    cfg = load_config(DEFAULT_CHECKPOINT)
    assert cfg == load_config(REPO / "assets" / "configs" / "small.json")
    # the header bytes are small: the data is exactly what the layout says
    assert sum(s.nbytes for s in tensor_specs(cfg)) <= total < sum(s.nbytes for s in tensor_specs(cfg)) + 2_000_000
    # the release plan and mechanisms are kept
    assert cfg.n_layers == 40 and cfg.kv_source_layers == (2, 8, 14, 20)
    assert cfg.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36) and cfg.engram_layer_ids == (1, 14)
    assert (cfg.vocab_size, cfg.engram_compressed_vocab_size, cfg.image_token_id) == (4096, 2804, 3)


def test_windows_cover_every_position_once():
    for n, w in ((10, 4), (9, 9), (2, 2), (5000, 2048)):
        spans = windows(n, w)
        predicted = [t for s, e in spans for t in range(s + 1, e)]
        assert predicted == list(range(1, n))
        assert all(e - s <= w for s, e in spans)


def test_heldout_loss_beats_baselines(slice_run):
    ids, loss, _ = slice_run
    counts = np.load(REPO / "assets" / "training" / "train_counts.npy")
    unigram = unigram_loss(ids, counts)
    # independent check of the unigram formula on this slice
    p = (counts[np.array(ids[1:])] + 1.0) / (counts.sum() + counts.size)
    assert unigram == pytest.approx(float(-np.log(p).mean()), rel=1e-12)
    assert loss < unigram - 2.5          # measured (run 9): 2.72 vs 6.27 nats/token (run 8: 2.82, run 7: 2.94)
    assert loss < math.log(4096) - 3.0   # uniform over the vocabulary is 8.32


@pytest.fixture(scope="module")
def heldout_loads(engine):
    """Expert loads per layer over the first 1,024 tokens of held-out prose plus 1,024 of held-out code."""
    loads = {}
    for domain in ("prose", "code"):
        text = (REPO / "assets" / "corpus" / f"heldout_{domain}.txt").read_text(encoding="utf-8")
        ids = engine.tokenizer.encode(text, add_bos=True)[:SLICE]
        collect: dict = {}
        with torch.inference_mode():
            engine.model.reset()
            engine.model.forward(torch.tensor(ids), probes=ProbeRequest(kinds={"routing"}), collect=collect)
            engine.model.reset()
        for layer, probe in collect.items():
            counts = torch.bincount(probe["routing"]["experts"].flatten(), minlength=engine.cfg.n_routed_experts)
            loads[layer] = loads.get(layer, 0) + counts.double()
    return loads


def test_no_dead_experts_on_heldout(heldout_loads, engine):
    cfg = engine.cfg
    assert sorted(heldout_loads) == list(range(cfg.n_layers))
    for layer, load_ in heldout_loads.items():
        assert load_.sum() == 2 * SLICE * cfg.experts_of(layer)[1]
        share = load_ / load_.mean()
        # the bar: 0.2x-3x of the fair share over held-out text. Measured on this sample (shipped model,
        # run 9): 0.31x at its lowest, 2.14x at most (both layer 36); over 8,192 tokens of each domain
        # together 0.66x-1.48x; prose alone 0.26x at its lowest (layer 39; run 8: 0.29x), assets/README.md
        assert share.min() >= 0.2, (layer, share.min().item())
        assert share.max() <= 3.0, (layer, share.max().item())


def test_picks_are_the_indexers_not_ties(slice_run, engine):
    """Issue 13's bar: at most 5% of the selected entries score exactly 0 at every Full and Reindex
    layer (a dead indexer's picks are zero-score ties broken by position). Measured on this slice:
    0.002%-0.5% (run 9); the model before run 3: 15%-91% on held-out text."""
    _, _, collect = slice_run
    for role in role_plan(engine.cfg):
        if role.role not in (FULL, REINDEX):
            continue
        probe = collect[role.layer]
        picked = probe["topk"] >= 0
        zero = (probe["topk_scores"] == 0) & picked
        assert int(picked.sum()) > 1000
        assert float(zero.sum() / picked.sum()) <= 0.05, role.layer


def test_indexer_is_not_recency(slice_run, engine):
    """Per index source, the mean overlap of the selected entries with the most recent k visible ones,
    over queries that see more than 2k entries. A recency rule gives 1.0; a uniformly random pick gives
    k/visible (0.15-0.23 on this slice). The trained indexer measured 0.02-0.20: we assert < 0.5."""
    _, _, collect = slice_run
    cfg, k = engine.cfg, engine.cfg.index_topk
    for role in engine.plan[: cfg.n_layers]:
        if role.role not in (FULL, REINDEX):
            continue
        topk = collect[role.layer]["topk"]
        overlaps = []
        for t in range(topk.shape[0]):
            visible = (t + 1) // role.compress_ratio
            if visible <= 2 * k:
                continue
            chosen = set(topk[t][topk[t] >= 0].tolist())
            assert len(chosen) == k and max(chosen) < visible
            overlaps.append(len(chosen & set(range(visible - k, visible))) / k)
        assert len(overlaps) > 100
        assert float(np.mean(overlaps)) < 0.5, (role.layer, float(np.mean(overlaps)))


def test_picks_hold_most_of_the_attention(engine):
    """Issue 13's bar: selection recall at least 0.8 on average at every selection layer - the share
    of the attention mass each query would put on its picks if it attended every visible entry (the
    engine's own probe, engine/model/selection_probe.py, not the trainer's), over queries that see more
    than k entries, on 1,024 held-out tokens of each domain. Measured (run 9): 0.967-0.998 on prose,
    0.982-1.000 on code (run 8: 0.949-0.997 / 0.984-1.000; run 4, before the focus term: 0.28-0.48)."""
    cfg, k = engine.cfg, engine.cfg.index_topk
    selection = [r.layer for r in role_plan(cfg) if r.role in (FULL, REINDEX)]
    for domain in ("prose", "code"):
        text = (REPO / "assets" / "corpus" / f"heldout_{domain}.txt").read_text(encoding="utf-8")
        ids = engine.tokenizer.encode(text, add_bos=True)[:SLICE]
        result = engine.run(ids, layers=selection, probes={"topk"}, detail_layers=selection)
        for layer in selection:
            m = cfg.compress_ratios[layer]
            crowded = torch.tensor([(t + 1) // m > k for t in range(len(ids))])
            recall = result.layers[layer].selection_recall[crowded]
            assert int(crowded.sum()) > 400 and not bool(recall.isnan().any())
            assert float(recall.mean()) >= 0.8, (domain, layer, float(recall.mean()))
