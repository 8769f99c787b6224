"""The serving planner at other widths: assets/configs/small.json and variants of it with one width
doubled. Every layer's decode and prefill FLOPs and bytes, the activations and the collectives per step
are counted here by hand from the config's shapes (the checkpoint layout of spec section 3), not from
the tally or the planner's helpers, and must follow each width."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import load_config
from engine.plan import PlanInputs, activation_bytes, layer_boxes, layer_work, phase
from engine.roles import role_plan
from engine.tally import tally_from_config

SMALL = load_config(Path(__file__).resolve().parents[1] / "assets" / "configs" / "small.json")
WIDTHS = [{}, {"dim": 512}, {"moe_inter_dim": 64}, {"head_dim": 256}, {"n_heads": 8}, {"q_lora_rank": 256},
          {"o_lora_rank": 128}, {"index_head_dim": 128}, {"index_n_heads": 8}, {"window_size": 64},
          {"vocab_size": 8192}, {"engram_head_dim": 64}, {"n_routed_experts": 64}]
POSITION, BATCH, CHUNK = 1000, 3, 256


def _name(changes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in changes.items()) or "small.json"


@pytest.fixture(scope="module", params=WIDTHS, ids=_name)
def case(request):
    cfg = SMALL.replace(**request.param)
    return cfg, tally_from_config(cfg)


def fp8(out: int, inp: int) -> int:
    """An FP8 matrix and its E8M0 scales, one per 32x32 block."""
    return out * inp + math.ceil(out / 32) * math.ceil(inp / 32)


def fp4(out: int, inp: int) -> int:
    """FP4 codes (two a byte) and one E8M0 scale per 32 inputs."""
    return out * inp // 2 + out * (inp // 32)


def kind(c, layer: int) -> str:
    """small.json's roles from its lists: ratio 0 window-only, KV sources Full, other index sources
    Reindex (all above the candidate source 20, so scoring its pool), the rest Reuse."""
    if c.compress_ratios[layer] == 0:
        return "swa"
    if layer in c.kv_source_layers:
        return "full"
    return "reindex" if layer in c.index_source_layers else "reuse"


def by_hand(c, layer: int, *, t: int, pos: int, decode: bool) -> tuple[dict, float]:
    """One layer on one GPU (tp = ep = 1): FLOPs per precision and HBM bytes of a decode step of `t`
    sequences at `pos` tokens, or of a prefill chunk of `t` tokens ending at `pos`."""
    d, q, nh, hd, og, ol = c.dim, c.q_lora_rank, c.n_heads, c.head_dim, c.o_groups, c.o_lora_rank
    ih, ihd, n_exp, k, inter, hc = c.index_n_heads, c.index_head_dim, c.n_routed_experts, \
        c.n_activated_experts, c.moe_inter_dim, c.hc_mult
    shared, mix, m, role = inter * c.n_shared_experts, (2 + hc) * hc, c.compress_ratios[layer], kind(c, layer)
    indexer, engram = role in ("full", "reindex"), layer in c.engram_layer_ids
    lookup = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
    # weights: norms, attention, gate, shared expert, mHC (F32 fn, base, scale for both branches)
    dense = 2 * d * 2 + nh * 4 + q * 2 + hd * 2 + fp8(q, d) + fp8(nh * hd, q) + fp8(hd, d) \
        + fp8(og * ol, nh * hd // og) + fp8(d, og * ol) + n_exp * d * 2 + 2 * n_exp * 4 \
        + 2 * fp8(shared, d) + fp8(d, shared) + 2 * (mix * hc * d * 4 + mix * 4 + 3 * 4)
    flops = {"fp8": 2 * t * (q * d + nh * hd * q + hd * d + d * og * ol + 3 * shared * d),
             "bf16": 2 * t * (ol * nh * hd + n_exp * d + 2 * mix * hc * d),
             "fp4": 2 * t * k * 3 * inter * d}
    if role == "full":          # compressor (kv, and a gate when it pools) and the index-key projection
        gates = 2 if m > 1 else 1
        dense += gates * hd * d * 2 + hd * 2 + ihd * hd * 2 + ihd * 2
        flops["bf16"] += 2 * t * gates * hd * d + 2 * (t / m) * ihd * hd
    if layer in c.index_source_layers:
        dense += fp8(ih * ihd, q) + ih * d * 2
        flops["fp8"] += 2 * t * ih * ihd * q
        flops["bf16"] += 2 * t * ih * d
    if engram:
        dense += fp8(d * (hc + 1), lookup) + 2 * hc * d * 2
        flops["fp8"] += 2 * t * d * (hc + 1) * lookup
        flops["bf16"] += 2 * 2 * t * hc * d
    touched = n_exp * (1 - (1 - k / n_exp) ** t)        # uniform routing
    nbytes = dense + touched * (2 * fp4(inter, d) + fp4(d, inter))
    # attention over the window and the selected global entries
    mid = pos if decode else max(1, pos - t // 2)
    window, selected = min(c.window_size, mid), (min(c.index_topk, mid // m) if m else 0)
    flops["bf16"] += 4 * t * nh * hd * (window + selected)
    win, entry, key = hd + hd // 32, hd // 2 + hd // 16, ihd // 2 + ihd // 32
    if decode:
        nbytes += t * (window * win + win + selected * entry)
    else:
        nbytes += (t + min(c.window_size, pos - t)) * win + t * win + (min(t * c.index_topk, mid // m) if m else 0) * entry
    if indexer:
        scored = mid // m if role == "full" else min(mid // m, c.candidate_topk_blocks * c.candidate_block_size)
        flops["fp4"] += 2 * t * ih * ihd * scored
        nbytes += scored * key * (t if decode else 1) + 2 * t * scored * 4
    if role == "full":
        nbytes += t / m * (entry + key)
    if engram:
        nbytes += t * (c.engram_max_ngram_size - 1) * c.engram_n_heads * (c.engram_head_dim + c.engram_head_dim // 32)
    return flops, nbytes


def test_small_json_roles_are_the_ones_counted():
    assert [r.role for r in role_plan(SMALL)[: SMALL.n_layers]] == [kind(SMALL, i) for i in range(SMALL.n_layers)]
    assert all(r.in_candidate_pool == (r.role == "reindex") for r in role_plan(SMALL))
    assert SMALL.n_mtp_layers == 0 and SMALL.vision_n_layers == 0


def test_every_layer_by_hand(case):
    """Each layer's FLOPs per precision and HBM bytes, decode and prefill, against the hand count."""
    cfg, tally = case
    p = PlanInputs(gpu="h200", gpus=1, ep=1, tp=1, batch=BATCH, context=POSITION, chunk=CHUNK)
    boxes = layer_boxes(tally)
    for r in role_plan(cfg)[: cfg.n_layers]:
        for decode, t in ((True, BATCH), (False, CHUNK)):
            w = layer_work(cfg, r, boxes[r.layer], p, tokens=t, total_tokens=t, sequences=t if decode else 1,
                           position=POSITION, decode=decode)
            flops, nbytes = by_hand(cfg, r.layer, t=t, pos=POSITION, decode=decode)
            for prec in ("fp8", "bf16", "fp4"):
                assert w.flops[prec] == pytest.approx(flops[prec], rel=1e-12), (r.layer, decode, prec)
            assert w.hbm_bytes == pytest.approx(nbytes, rel=1e-12), (r.layer, decode)
            assert w.link_bytes == 0


def test_role_rows_and_head_by_hand(case):
    """The per-role table (decode step and prefill chunk) and the head row at these widths."""
    cfg, tally = case
    p = PlanInputs(gpu="h200", gpus=1, ep=1, tp=1, batch=BATCH, context=POSITION, chunk=CHUNK)
    for decode, t in ((True, BATCH), (False, CHUNK)):
        rows = phase(cfg, tally, p, decode=decode, position=POSITION).rows
        assert sorted(x for r in rows for x in r.layers) == list(range(cfg.n_layers))
        for r in rows[:-1]:
            hand = [by_hand(cfg, layer, t=t, pos=POSITION, decode=decode) for layer in r.layers]
            assert r.flops == pytest.approx(sum(sum(f.values()) for f, _ in hand) / len(hand), rel=1e-12), r.role
            assert r.hbm_bytes == pytest.approx(sum(b for _, b in hand) / len(hand), rel=1e-12), r.role
        head = rows[-1]
        head_tokens = t if decode else 1
        assert head.role == "embedding + head"
        assert head.flops == 2 * cfg.vocab_size * cfg.dim * head_tokens
        assert head.hbm_bytes == cfg.vocab_size * cfg.dim * 2 + t * cfg.dim * 2


def test_activations_by_hand(case):
    cfg, _ = case
    p = PlanInputs(gpu="h200", gpus=1, ep=1, tp=1, batch=1, context=POSITION, chunk=CHUNK)
    a = activation_bytes(cfg, p, POSITION)
    t = CHUNK
    scores = POSITION * t * 4              # layer 20 (Full m=1) scores every entry; the pool only 256
    attention = 2 * t * cfg.n_heads * cfg.head_dim * 2 + scores
    moe = t * cfg.n_activated_experts * (cfg.dim + 2 * cfg.moe_inter_dim * 2 + cfg.dim * 2) \
        + t * 2 * cfg.moe_inter_dim * 2
    assert (a["stream"], a["index_scores"], a["attention"], a["moe"]) == (2 * t * 4 * cfg.dim * 2, scores, attention, moe)
    assert a["total"] == a["stream"] + max(attention, moe)


def _scored(cfg, layer: int, mid: int) -> int:
    m, role = cfg.compress_ratios[layer], kind(cfg, layer)
    if role == "full":
        return mid // m
    return min(mid // m, cfg.candidate_topk_blocks * cfg.candidate_block_size) if role == "reindex" else 0


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_collectives_by_hand(case, decode):
    """Bytes each GPU sends per step: TP 2 x EP 2 on 2 GPUs, and DP attention on 4 GPUs (2 groups of 2)."""
    cfg, tally = case
    n, d, k = cfg.n_layers, cfg.dim, cfg.n_activated_experts
    mid = POSITION if decode else POSITION - CHUNK // 2
    scored = sum(_scored(cfg, layer, mid) for layer in range(n))
    rows = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    row_bytes = cfg.engram_head_dim + cfg.engram_head_dim // 32
    n_engram = len(cfg.engram_layer_ids)

    p = PlanInputs(gpu="h200", gpus=2, ep=2, tp=2, batch=BATCH, context=POSITION, chunk=CHUNK)
    t = BATCH if decode else CHUNK
    comm = phase(cfg, tally, p, decode=decode, position=POSITION).comm
    ring = 2 * (2 - 1) / 2                 # ring all-reduce over 2: each sends its half twice
    assert comm == pytest.approx({
        "attention all-reduce": n * ring * t * d * 2, "MoE all-reduce": n * ring * t * d * 2,
        "index scores all-reduce": ring * t * scored * 4, "Engram rows (all-to-all)": n_engram * t * rows * row_bytes / 2,
        "embedding all-reduce": ring * t * d * 2, "logits all-gather": (t if decode else 1) * cfg.vocab_size * 4 / 2},
        rel=1e-12)

    dp = replace(p, gpus=4, ep=4, dp_attention=True, batch=2 * BATCH)
    comm = phase(cfg, tally, dp, decode=decode, position=POSITION).comm
    local = t / 2 * k * 3 / 4              # a GPU's half of its group's tokens, 3 in 4 experts elsewhere
    assert comm == pytest.approx({
        "attention all-reduce": n * ring * t * d * 2, "MoE dispatch (all-to-all)": n * local * d,
        "MoE combine (all-to-all)": n * local * d * 2, "MoE all-gather in group": n * t / 2 * d * 2,
        "index scores all-reduce": ring * t * scored * 4, "Engram rows (all-to-all)": n_engram * t * rows * row_bytes * 3 / 4,
        "embedding all-reduce": ring * t * d * 2, "logits all-gather": (t if decode else 1) * cfg.vocab_size * 4 / 2},
        rel=1e-12)

    # 4 groups of 1 over 2 copies of the experts: a token's expert is on its own GPU 1 time in 2
    dp_copies = replace(dp, ep=2, tp=1, batch=4 * BATCH)
    comm = phase(cfg, tally, dp_copies, decode=decode, position=POSITION).comm
    local = t * k / 2
    assert comm == pytest.approx({
        "MoE dispatch (all-to-all)": n * local * d, "MoE combine (all-to-all)": n * local * d * 2,
        "Engram rows (all-to-all)": n_engram * t * rows * row_bytes * 3 / 4}, rel=1e-12)


@pytest.mark.parametrize("dp", [False, True])
def test_engram_rows_read_per_gpu(case, dp):
    """Rows spread over 4 GPUs (2 groups of 2): without DP attention every GPU asks for the same
    tokens, so each reads a quarter of them; with it each group asks for its own, so each GPU reads
    the rows of one group's tokens over the 2 GPUs of a group."""
    cfg, tally = case
    p = PlanInputs(gpu="h200", gpus=4, ep=4, tp=2, dp_attention=dp, batch=2 * BATCH, context=POSITION)
    t = p.sequences_per_gpu()
    role, boxes = role_plan(cfg)[1], layer_boxes(tally)[1]
    assert role.engram
    on_gpu, on_host = (layer_work(cfg, role, boxes, replace(p, engram=where), tokens=t, total_tokens=2 * BATCH,
                                  sequences=t, position=POSITION, decode=True) for where in ("gpu", "host"))
    rows = t * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
    assert on_gpu.hbm_bytes - on_host.hbm_bytes == pytest.approx(rows * (2 if dp else 1) / 4, rel=1e-12)


def test_doubling_a_width_scales_each_term():
    """Without the hand count: a Reuse m=2 layer's matmul FLOPs are linear in dim except the dim-free
    wq_b (FP8), wo_a and the attention core (BF16); the experts' FP4 FLOPs double with dim and with
    moe_inter_dim; the all-reduces double with dim, the logits with the vocabulary, the index scores
    with neither."""
    def figures(cfg):
        tally = tally_from_config(cfg)
        p = PlanInputs(gpu="h200", gpus=2, ep=2, tp=2, batch=1, context=POSITION)
        w = layer_work(cfg, role_plan(cfg)[3], layer_boxes(tally)[3], PlanInputs(gpus=1, ep=1, tp=1, batch=1),
                       tokens=1, total_tokens=1, sequences=1, position=POSITION, decode=True)
        return w.flops, phase(cfg, tally, p, decode=True, position=POSITION).comm

    (f1, c1), (f2, c2) = figures(SMALL), figures(SMALL.replace(dim=2 * SMALL.dim))
    c = SMALL
    wq_b = 2 * c.n_heads * c.head_dim * c.q_lora_rank
    wo_a = 2 * c.o_lora_rank * c.n_heads * c.head_dim
    core = 4 * c.n_heads * c.head_dim * (c.window_size + c.index_topk)
    assert f2["fp8"] == pytest.approx(2 * f1["fp8"] - wq_b, rel=1e-12)
    assert f2["bf16"] == pytest.approx(2 * f1["bf16"] - wo_a - core, rel=1e-12)
    assert f2["fp4"] == pytest.approx(2 * f1["fp4"], rel=1e-12)
    for what in ("attention all-reduce", "MoE all-reduce", "embedding all-reduce"):
        assert c2[what] == pytest.approx(2 * c1[what], rel=1e-12)
    for what in ("index scores all-reduce", "logits all-gather", "Engram rows (all-to-all)"):
        assert c2[what] == pytest.approx(c1[what], rel=1e-12)
    f3, c3 = figures(SMALL.replace(moe_inter_dim=2 * SMALL.moe_inter_dim, vocab_size=2 * SMALL.vocab_size))
    shared = 2 * 3 * c.moe_inter_dim * c.dim
    assert f3["fp4"] == pytest.approx(2 * f1["fp4"], rel=1e-12)
    assert f3["fp8"] == pytest.approx(f1["fp8"] + shared, rel=1e-12)
    assert c3["logits all-gather"] == pytest.approx(2 * c1["logits all-gather"], rel=1e-12)
