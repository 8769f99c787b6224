"""The serving planner's work per layer and its roofline (engine/plan.py) against hand counts from the
spec's shapes, the independent count benches/parallel.py stored with its H200 run, and sums."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import release_config
from engine.plan import GPUS, PlanInputs, layer_boxes, layer_work, make_plan, phase, ttft
from engine.roles import role_plan
from engine.tally import tally_from_config

RESULTS = Path(__file__).resolve().parents[1] / "benches" / "results"


@pytest.fixture(scope="module")
def cfg():
    return release_config()


@pytest.fixture(scope="module")
def tally(cfg):
    return tally_from_config(cfg)


@pytest.fixture(scope="module")
def boxes(tally):
    return layer_boxes(tally)


def _fp8(out: int, inp: int) -> int:
    """Bytes of an FP8 weight with one E8M0 scale per 32x32 block."""
    return out * inp + -(-out // 32) * -(-inp // 32)


def test_reuse_layer_decode_by_hand(cfg, boxes):
    """Layer 3 (Reuse, m=2), one sequence at 131,072 tokens, one GPU: FLOPs per precision and bytes read."""
    p = PlanInputs(gpu="b200", gpus=1, ep=1, tp=1, batch=1, context=131072)
    role = role_plan(cfg)[3]
    w = layer_work(cfg, role, boxes[3], p, tokens=1, total_tokens=1, sequences=1, position=131072, decode=True)
    fp8 = 2 * (5120 * 1280 + 1280 * 32768 + 5120 * 512 + 8192 * 5120 + 3 * 5120 * 2304)
    bf16 = 2 * 8192 * 4096 + 4 * 64 * 512 * (128 + 512) + 2 * 384 * 5120 + 2 * 2 * 24 * 20480
    fp4 = 6 * 3 * 2 * 5120 * 2304
    assert w.flops["fp8"] == pytest.approx(fp8, rel=1e-12)
    assert w.flops["bf16"] == pytest.approx(bf16, rel=1e-12)
    assert w.flops["fp4"] == pytest.approx(fp4, rel=1e-12)
    dense = (64 * 4 + 512 * 2 + 1280 * 2 + _fp8(512, 5120) + _fp8(8192, 4096) + _fp8(5120, 8192) + _fp8(1280, 5120)
             + _fp8(32768, 1280) + 2 * 5120 * 2 + 384 * 5120 * 2 + 2 * 384 * 4 + 2 * _fp8(2304, 5120)
             + _fp8(5120, 2304) + 2 * (24 * 20480 * 4 + 24 * 4 + 3 * 4))
    expert = 2 * (2304 * 2560 + 2304 * 160) + 5120 * 1152 + 5120 * 72    # FP4 codes + E8M0 per 32
    kv = 128 * 528 + 528 + 512 * 288                                     # window, its new entry, the top-512
    assert w.hbm_bytes == pytest.approx(dense + 6 * expert + kv, rel=1e-12)   # one token touches 6 experts
    assert w.link_bytes == 0


def test_prefill_flops_match_the_benchs_own_count(cfg, tally):
    """benches/parallel.py counted each layer's prefill FLOPs per GPU on its own (2 H200s, 4,096 tokens,
    heads and experts split in two); window-only and Reuse layers must agree with it."""
    run = json.loads((RESULTS / "parallel-h200x2-25layers.json").read_text())
    p = PlanInputs(gpu="h200", gpus=2, ep=2, tp=2, batch=1, context=run["tokens"], chunk=run["tokens"])
    rows = {r.role: r for r in phase(cfg, tally, p, decode=False, position=run["tokens"]).rows}
    measured = {layer["layer"]: layer for layer in run["layers"]}
    assert rows["SWA-only"].flops / 1e9 == pytest.approx(measured[0]["gflop_per_gpu"], abs=2e-3)
    assert rows["SWA-only + Engram"].flops / 1e9 == pytest.approx(measured[1]["gflop_per_gpu"], rel=1e-3)
    assert rows["Reuse m=2"].flops / 1e9 == pytest.approx(measured[3]["gflop_per_gpu"], abs=2e-3)
    assert rows["Reuse m=1"].flops / 1e9 == pytest.approx(measured[21]["gflop_per_gpu"], abs=2e-3)


def test_collectives_by_hand(cfg, tally):
    # engine layout: 8 GPUs, heads and experts over all 8, one token each step
    p = PlanInputs(gpu="h200", gpus=8, ep=8, tp=8, batch=1, context=1000)
    ph = phase(cfg, tally, p, decode=True, position=1000)
    ring = 2 * 7 / 8 * 5120 * 2                     # a ring all-reduce of one bf16 row
    assert ph.comm["attention all-reduce"] == pytest.approx(40 * ring)
    assert ph.comm["MoE all-reduce"] == pytest.approx(40 * ring)
    scored = 3 * 500 + 1000 + 4 * 1000                  # m=2 sources, layer 20, 4 Reindex layers (pool > 1000)
    assert ph.comm["index scores all-reduce"] == pytest.approx(2 * 7 / 8 * 4 * scored)
    assert ph.comm["logits all-gather"] == pytest.approx(7 / 8 * 129280 * 4)
    # DP attention: 64 sequences over 8 groups of 1; each token goes to 6 experts, 7 in 8 elsewhere
    dp = phase(cfg, tally, replace(p, tp=1, dp_attention=True, batch=64), decode=True, position=1000)
    assert dp.tokens == 8
    assert dp.comm["MoE dispatch (all-to-all)"] == pytest.approx(40 * 8 * 6 * 7 / 8 * 5120)
    assert dp.comm["MoE combine (all-to-all)"] == pytest.approx(40 * 8 * 6 * 7 / 8 * 5120 * 2)
    assert "attention all-reduce" not in dp.comm


def test_roofline_takes_the_slowest_resource(cfg, tally):
    gpu = GPUS["h200"]
    p = PlanInputs(gpu="h200", gpus=8, ep=8, tp=8, batch=32, context=262144)
    for decode in (True, False):
        ph = phase(cfg, tally, p, decode=decode, position=p.context)
        for r in ph.rows:
            if len(r.layers) == 1:
                assert r.time_s == pytest.approx(max(r.times.values()))
                assert r.limit == max(r.times, key=r.times.get)
        assert ph.time_s == pytest.approx(sum(r.total_s for r in ph.rows))
        first = ph.rows[0]
        assert first.times["HBM"] == pytest.approx(first.hbm_bytes / gpu.hbm_Bps)
        assert first.times["interconnect"] == pytest.approx(first.link_bytes / gpu.link_Bps)
    plan = make_plan(cfg, replace(p, batch=1, context=4096), tally)
    assert plan.decode.limit == "HBM"                   # one token: weights streaming
    assert plan.prefill.limit == "compute"              # 4,096 tokens a chunk
    assert plan.tokens_per_s == pytest.approx(1 / plan.decode.time_s)


def test_engram_on_disk_is_page_reads(cfg, tally):
    p = PlanInputs(gpu="h200", gpus=8, ep=8, tp=1, dp_attention=True, batch=2048, context=4096, engram="disk")
    ph = phase(cfg, tally, p, decode=True, position=4096)
    reads = 2 * (2048 // 8) * 24                        # two Engram layers, 24 rows a token
    assert ph.fetch_s == pytest.approx(max(reads / 1e6, reads * 4096 / 7e9))
    layers = sum(r.total_s for r in ph.rows)
    assert ph.time_s == max(layers, ph.fetch_s)
    assert (ph.limit == "Engram fetch") == (ph.fetch_s > layers)
    host = phase(cfg, tally, replace(p, engram="host"), decode=True, position=4096)
    assert host.fetch_s == pytest.approx(2 * 256 * 24 * 264 / 64e9)


def test_ttft_sums_the_chunks(cfg, tally):
    p = PlanInputs(gpu="h200", gpus=8, ep=8, tp=8, batch=1, context=5 * 4096 - 100)
    exact = sum(phase(cfg, tally, replace(p, chunk=min(4096, p.context - j * 4096)), decode=False,
                      position=min(p.context, (j + 1) * 4096)).time_s for j in range(5))
    assert ttft(cfg, tally, p) == pytest.approx(exact, rel=1e-12)
    long = replace(p, context=48 * 4096)                # sampled: 24 chunks stand for 48
    exact_long = sum(phase(cfg, tally, long, decode=False, position=(j + 1) * 4096).time_s for j in range(48))
    assert ttft(cfg, tally, long) == pytest.approx(exact_long, rel=0.01)
