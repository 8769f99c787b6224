"""The serving planner's bytes per GPU (engine/plan.py) against the release figures, hand counts and the
split engine/serve/parallel.py makes."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace

import pytest

from engine.config import release_config
from engine.checkpoint.layout import tensor_specs
from engine.plan import (CACHE_PARTS, GPUS, PlanError, PlanInputs, TP_BOXES, cache_per_sequence, check_inputs,
                         largest_batch, largest_context, make_plan, memory, model_max_context, weights_per_gpu)
from engine.tally import tally_from_config
from engine_helpers import release_lists_config

RELEASE_BYTES = 510_286_023_000
MAX_CONTEXT = 1_048_576


@pytest.fixture(scope="module")
def cfg():
    return release_config()


@pytest.fixture(scope="module")
def tally(cfg):
    return tally_from_config(cfg)


def one_gpu(**changes) -> PlanInputs:
    return replace(PlanInputs(gpu="b200", gpus=1, ep=1, tp=1, batch=1, context=MAX_CONTEXT), **changes)


def test_release_caches_at_the_longest_context(cfg, tally):
    """1 GPU, batch 1, 1,048,576 tokens: 890 B per token of global KV (288 B entry + 68 B index key, 2.5
    entries a token) and 128 x 528 B of window per layer."""
    assert model_max_context(cfg) == MAX_CONTEXT
    m = memory(cfg, tally, one_gpu(dspark=False))
    assert m.caches["global KV"] + m.caches["index keys"] == 890 * MAX_CONTEXT
    assert m.caches["global KV"] == 2.5 * 288 * MAX_CONTEXT and m.caches["index keys"] == 2.5 * 68 * MAX_CONTEXT
    assert m.caches["sliding windows"] == 40 * 128 * 528
    assert [(s["layer"], s["entries"]) for s in m.cache_by_source] == [(2, MAX_CONTEXT // 2), (8, MAX_CONTEXT // 2),
                                                                      (14, MAX_CONTEXT // 2), (20, MAX_CONTEXT)]
    # DSpark's three stages keep windows too; the m=2 compressors hold at most one token (kv + score, fp32)
    with_dspark = memory(cfg, tally, one_gpu())
    assert with_dspark.caches["sliding windows"] == 43 * 128 * 528
    assert with_dspark.caches["pending compressor state"] == 3 * 1 * 2 * 512 * 4
    assert cache_per_sequence(cfg, 1001, exact_pending=True)["pending compressor state"] == 3 * 2 * 512 * 4
    assert cache_per_sequence(cfg, 1000, exact_pending=True)["pending compressor state"] == 0


def test_one_gpu_holds_the_whole_checkpoint(cfg, tally):
    w = weights_per_gpu(cfg, tally, one_gpu())
    assert sum(w.values()) == RELEASE_BYTES
    assert w["Engram tables"] == 101_380_404_048 + 101_377_628_352
    off = weights_per_gpu(cfg, tally, one_gpu(engram="host", dspark=False, vision=False))
    assert off["Engram tables"] == off["DSpark"] == off["vision tower"] == 0
    assert make_plan(cfg, one_gpu(engram="disk"), tally).memory.host_bytes == w["Engram tables"]


SPLIT_BY_TP = re.compile(r"(embed|head)\.weight|layers\.\d+\.attn\.(wq_b|attn_sink|wo_a|wo_b|indexer\.wq_b"
                         r"|indexer\.weights_proj)(\.weight|\.scale)?")
ROUTED = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.")
TABLE = re.compile(r"layers\.\d+\.engram\.embed\.")


@pytest.fixture(scope="module")
def bytes_by_split(cfg):
    """The release's bytes by how a layout stores them, from the tensor names alone: routed experts
    (backbone and DSpark: split by ep), the heads'/vocabulary's tensors (split by tp), Engram tables
    (rows over every GPU), everything else (a copy on every GPU)."""
    out = {"experts": 0, "tp": 0, "tables": 0, "replicated": 0}
    for s in tensor_specs(cfg):
        what = ("experts" if ROUTED.match(s.name) else "tp" if SPLIT_BY_TP.fullmatch(s.name)
                else "tables" if TABLE.match(s.name) else "replicated")
        out[what] += s.nbytes
    assert sum(out.values()) == RELEASE_BYTES
    return out


def test_the_split_names_are_the_engines(cfg):
    """The name patterns above are engine/serve/parallel.py's split_of / expert_of for the backbone."""
    from engine.serve.parallel import expert_of, split_of
    for s in tensor_specs(cfg):
        if s.name.startswith("layers.") or s.name in ("embed.weight", "head.weight"):
            weight = s.name[: -len(".scale")] + ".weight" if s.name.endswith(".scale") else s.name
            assert bool(SPLIT_BY_TP.fullmatch(s.name)) == (split_of(weight) is not None), s.name
            assert bool(ROUTED.match(s.name)) == (expert_of(s.name) is not None), s.name


@pytest.mark.parametrize("gpus,ep,tp", [(8, 8, 1), (8, 8, 2), (8, 8, 4), (8, 8, 8), (8, 4, 2), (8, 2, 4), (8, 1, 8),
                                        (8, 1, 1), (4, 4, 1), (4, 2, 4), (2, 2, 2), (16, 16, 8), (16, 8, 2), (1, 1, 1)])
def test_weights_over_all_gpus_are_the_total_plus_the_replicas(cfg, tally, bytes_by_split, gpus, ep, tp):
    """Every GPU holds the same; over all GPUs that is the release total plus exactly the replicated
    copies: gpus/ep - 1 more of the routed experts, gpus/tp - 1 more of the TP-split tensors, gpus - 1
    more of everything else, none of the Engram tables (their rows are spread); with the tables in host
    memory, the total without them. DP attention changes no weight."""
    b = bytes_by_split
    replicas = (gpus // ep - 1) * b["experts"] + (gpus // tp - 1) * b["tp"] + (gpus - 1) * b["replicated"]
    assert (replicas == 0) == (gpus == 1)
    for dp in (False, True):
        for engram, tables in (("gpu", b["tables"]), ("host", 0)):
            p = replace(PlanInputs(), gpus=gpus, ep=ep, tp=tp, dp_attention=dp, engram=engram)
            per_gpu = sum(weights_per_gpu(cfg, tally, p).values())
            expected = RELEASE_BYTES - b["tables"] + tables + replicas
            assert per_gpu * gpus == pytest.approx(expected, rel=0, abs=gpus * 1e-3), (dp, engram)


def test_tp_boxes_are_the_engines_split_weights(cfg):
    from engine.serve.parallel import expert_of, split_of
    for s in tensor_specs(cfg):
        if s.group in ("dspark", "vision"):
            continue
        weight = s.name[: -len(".scale")] + ".weight" if s.name.endswith(".scale") else s.name
        assert (s.kind in TP_BOXES) == (split_of(s.name) is not None or split_of(weight) is not None), s.name
        assert s.kind.startswith("ffn.experts.") == (expert_of(s.name) is not None), s.name


def test_kv_per_gpu_follows_the_layout(cfg, tally):
    """TP does not split the one latent KV head; DP attention gives each group its share of the batch."""
    one = cache_per_sequence(cfg, 131072)
    per_seq = sum(one[k] for k in CACHE_PARTS)
    base = PlanInputs(gpus=8, ep=8, batch=60, context=131072)
    for tp, dp, seqs in ((1, False, 60), (8, False, 60), (1, True, 8), (2, True, 15)):
        m = memory(cfg, tally, replace(base, tp=tp, dp_attention=dp))
        assert m.sequences_per_gpu == seqs
        assert sum(m.caches.values()) == seqs * per_seq


def test_largest_batch_and_context_are_the_boundary(cfg, tally):
    for p in (PlanInputs(gpu="h200", gpus=8, ep=8, tp=1, batch=64, context=131072),
              PlanInputs(gpu="h100", gpus=8, ep=8, tp=8, batch=8, context=65536, engram="host"),
              PlanInputs(gpu="mi300x", gpus=8, ep=8, tp=1, dp_attention=True, batch=64, context=400_000)):
        b = largest_batch(cfg, tally, p)
        assert b > 0
        step = p.groups if p.dp_attention else 1
        assert memory(cfg, tally, replace(p, batch=b)).fits
        assert not memory(cfg, tally, replace(p, batch=b + step)).fits
        c = largest_context(cfg, tally, p)
        assert memory(cfg, tally, replace(p, context=c)).fits
        assert c == MAX_CONTEXT or not memory(cfg, tally, replace(p, context=c + 1)).fits


def test_nothing_fits_says_zero(cfg, tally):
    p = PlanInputs(gpu="h100", gpus=1, ep=1, tp=1, batch=1, context=1000)   # 510 GB on 80 GB
    plan = make_plan(cfg, p, tally)
    assert not plan.memory.fits and plan.memory.free < 0
    assert plan.largest_batch == 0 and plan.largest_context == 0


def test_other_widths_change_every_figure(tally):
    """A 40-layer config with the release's lists at small widths: its own checkpoint on one GPU, its KV
    bytes from its head and index widths, its windows from its window size."""
    small = release_lists_config()
    t = tally_from_config(small)
    p = PlanInputs(gpu="h200", gpus=1, ep=1, tp=1, batch=3, context=4096)
    assert sum(weights_per_gpu(small, t, p).values()) == t.checkpoint_bytes != RELEASE_BYTES
    m = memory(small, t, replace(p, dspark=False))
    entry = small.head_dim // 2 + small.head_dim // 16            # 32 + 4
    key = small.index_head_dim // 2 + small.index_head_dim // 32   # 16 + 1
    assert m.caches["global KV"] + m.caches["index keys"] == 3 * 4096 * 2.5 * (entry + key)
    assert m.caches["sliding windows"] == 3 * 40 * small.window_size * (small.head_dim + small.head_dim // 32)
    assert model_max_context(small) == 4096 * 16
    wide = release_config().replace(head_dim=256)
    assert cache_per_sequence(wide, 1000)["global KV"] == 2.5 * 1000 * (128 + 16)


@pytest.mark.parametrize("changes,words", [
    (dict(gpu="a100"), "unknown GPU 'a100'"), (dict(tp=3), "tp=3 does not divide gpus=8"),
    (dict(gpus=6, tp=6, ep=6), "tp=6 cannot split n_heads=64"), (dict(gpus=5, ep=5, tp=1), "ep=5 cannot split"),
    (dict(context=MAX_CONTEXT + 1), "context must be a whole number from 1"), (dict(batch=0), "batch must be a whole number from 1 to 1,000,000"),
    (dict(engram="cloud"), "engram must be one of gpu, host, disk"), (dict(reserve=1.5), "reserve must be")])
def test_bad_inputs_name_the_input(cfg, changes, words):
    with pytest.raises(PlanError, match=words.replace("(", r"\(")):
        check_inputs(cfg, replace(PlanInputs(), **changes))


def test_datasheet_figures():
    assert (GPUS["h200"].hbm_bytes, GPUS["h200"].hbm_Bps, GPUS["h200"].fp8_flops) == (141e9, 4.8e12, 1979e12)
    assert GPUS["b200"].rate("fp4") == 2 * GPUS["b200"].rate("fp8") == 4 * GPUS["b200"].rate("bf16")
    assert GPUS["mi300x"].rate("fp4") == GPUS["mi300x"].rate("fp8") == 2614.9e12   # no FP4: FP8 rate


def test_planner_needs_no_torch():
    code = "import sys, engine.plan; engine.plan.make_plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
