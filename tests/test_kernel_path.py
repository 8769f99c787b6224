"""The engine's kernel ops (engine/ops/triton.py) and their parity checks (engine/run/parity.py) on the CPU, with the
Triton kernels under the interpreter, on a tiny written checkpoint.

The interpreter must be on before triton is imported, so the kernel runs happen in subprocesses
(this file run as a script, its two halves at once: the interpreted kernels are slow and the test
process only waits); the tests assert on the JSON they print, merged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from engine_helpers import IdentityTokenizer, check_same_experts_but_near_ties, random_ids, tiny_config  # noqa: E402

N_TOKENS = 16
PARITY_LAYERS = (2, 7)  # Full m=2 (all visible); Reindex inside the candidate pool (pool-masked)


def _config():
    return tiny_config()


# -- the subprocess ---------------------------------------------------------------------------------

def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _worker(ckpt: str, part: str) -> dict:
    """Runs with TRITON_INTERPRET=1. Part "a": the reference forward, the kernel forwards and the hooks'
    operands; part "b": TritonOps over `reference` numerics and the layer parity. (Independent halves
    of about equal time, run as two processes.)"""
    from engine.run import parity as K
    from engine.run.api import Engine
    from engine.ops.triton import TritonOps
    from engine.checkpoint.reader import CheckpointReader
    from engine.model.transformer import Model
    from engine.run.probes import ProbeRequest
    from engine.checkpoint.weights import CheckpointWeights

    cfg = _config()
    weights = CheckpointWeights(CheckpointReader(ckpt, cfg))
    ids = random_ids(cfg, N_TOKENS, seed=3)

    def forward(kernels, wrap_linear=None, knobs=""):
        model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), kernels=kernels)
        if knobs:
            model.ops.set_knobs(knobs)
        if wrap_linear is not None:
            model.linear = wrap_linear(model.linear)
            model.reset()
        collect: dict = {}
        with torch.inference_mode():
            logits = model.forward(ids, probes=ProbeRequest(kinds={"topk"}), collect=collect)
        topk = {L: p["topk"] for L, p in collect.items() if "topk" in p}
        return logits, topk, dict(model.ops.calls) if model.ops.kernels else {}, collect

    out = {"interpreter": K.interpreter_active()}
    if part == "b":
        out["reference_kernels"] = reference_on_kernels(cfg, weights, ids)
        # layer parity through an Engine (the app's entry point)
        engine = Engine(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size))
        out["parity"] = {str(L): K.layer_parity(engine, ids.tolist(), L) for L in PARITY_LAYERS}
        out["parity_rows"] = K.layer_parity(engine, ids.tolist(), 7, max_rows=4)
        return out

    ref_logits, ref_topk, ref_calls, ref_collect = forward(False)

    def against_ref(logits, topk):
        d = logits - ref_logits
        return {"rel_l2": (d.norm() / ref_logits.norm()).item(), "max_abs": d.abs().max().item(),
                "finite": bool(torch.isfinite(logits).all()),
                "topk_identical": {str(L): float((topk[L] == ref_topk[L]).all(-1).float().mean()) for L in ref_topk}}

    out["ref_calls"] = ref_calls
    # exact-precision kernels only (mHC, quantizer, indexer scores, top-k): the bf16-output ops left to
    # the wrapped numerics
    saved = {name: getattr(TritonOps, name) for name in ("linear", "gemm_of", "rms_norm", "sparse_attention",
                                                                 "routed_experts")}
    for name in saved:
        setattr(TritonOps, name, lambda self, *a, _name=name, **k: getattr(self.base, _name)(*a, **k))
    logits, topk, calls, kernel_collect = forward(True)
    out["fp32_kernels"] = {**against_ref(logits, topk), "calls": calls}
    # the tie marks of fp32 numerics on both routes: these two forwards are the CPU route (Fp32Ops, the
    # model's default numerics) and the kernel route (TritonOps over Fp32Ops, exact-precision kernels)
    out["ties"] = {"fp32": tie_marks(ref_collect, kernel_collect),
                   "top_up": tie_marks_on_both_routes(cfg, weights, ids, TopUpFp32Ops)}
    for name, fn in saved.items():
        setattr(TritonOps, name, fn)
    # every kernel (the sparse attention in the wrapper's default, its two passes' bf16x2 form on a prompt), then
    # the one-pass kernel's layouts (knob attn_one_pass): which two-pass forms ran in each
    import kernels.sparse_attn_decode as AD
    two_pass, ran = AD.sparse_attn_two_pass, []
    AD.sparse_attn_two_pass = lambda *a, **k: (ran.append(k.get("decode")), two_pass(*a, **k))[1]
    try:
        for key, knobs in (("all_kernels", None), ("attn_one_pass", "attn_one_pass=1")):
            ran.clear()
            logits, topk, calls, _ = forward(True, knobs=knobs)
            out[key] = {**against_ref(logits, topk), "calls": calls, "forms": sorted(set(map(str, ran))),
                        "two_pass_calls": len(ran)}
    finally:
        AD.sparse_attn_two_pass = two_pass
    # the reference's own sensitivity to the kernels' output precision: its linears rounded to bf16
    bf16 = lambda lin: (lambda x, base, **kw: lin(x, base, **kw).to(torch.bfloat16).float() if base is not None
                        else lin(x, base))
    logits, topk, _, _ = forward(False, bf16)
    out["bf16_reference"] = against_ref(logits, topk)
    # the hooks hand the kernels the engine's own operands: the kernels' references on the captured
    # arguments equal the engine's reference computations on the same inputs (layer 7)
    from engine.model.moe import routed_experts
    from kernels import dispatch
    model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), kernels=False)
    plain = model.ops
    capture = TritonOps(plain, weights, "cpu", compute=False, capture_layer=7)
    model.use_ops(capture)
    probe: dict = {}
    with torch.inference_mode():
        model.forward(ids, probes=ProbeRequest(layers={7}, kinds={"routing"}), collect=probe)
    model.use_ops(plain)
    route = probe[7]["routing"]
    got = {}
    for kernel, case, args, kwargs in capture.captured:
        ref = dispatch._PAIRS.get(kernel, (None,))[0]
        if kernel == "moe_fp4":  # the engine's routing (probe), its FP8 rounding of x and of w * h
            mine = routed_experts(cfg, "layers.7.ffn.", args[0].float(), route["experts"], route["weights"],
                                  model.get, model.linear, act=plain.act, gemm=plain.gemm)
            got["moe_fp4"] = rel(ref(*args, **kwargs), mine)
        elif kernel == "fp8_linear":
            got[case] = rel(ref(*args).float(), model.linear(args[0], "layers.7." + case))
    out["hook_operands"] = got
    return out


class _TopUp:
    """fp32 numerics that top a short candidate pool up as `reference` does (engine/ops tops_up_pool):
    the top-up on both routes without the bf16 scores that make the two routes' scores differ."""
    tops_up_pool = True


def TopUpFp32Ops():
    from engine.ops.fp32 import Fp32Ops
    return type("TopUpFp32Ops", (_TopUp, Fp32Ops), {})()


def _probed(cfg, weights, ids, ops, kinds=frozenset({"topk"})):
    """The forward on `ops` (the CPU route, or the kernel route with TritonOps): logits and probes."""
    from engine.model.transformer import Model
    from engine.run.probes import ProbeRequest

    model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), kernels=False)
    model.use_ops(ops)
    collect: dict = {}
    with torch.inference_mode():
        logits = model.forward(ids, probes=ProbeRequest(kinds=set(kinds)), collect=collect)
    return logits, collect


def tie_marks_on_both_routes(cfg, weights, ids, make_ops) -> dict:
    """Per picking layer: the CPU route's and the kernel route's picks and tie marks (k-th score, tied
    picks) on the exact-precision kernels (fp32 scores both), and how many picks the pool top-up took
    from outside the candidate pool."""
    from engine.ops.triton import TritonOps

    _, cpu = _probed(cfg, weights, ids, make_ops())
    _, kern = _probed(cfg, weights, ids, TritonOps(make_ops(), weights, "cpu"))
    return tie_marks(cpu, kern)


def tie_marks(cpu: dict, kern: dict) -> dict:
    """tie_marks_on_both_routes on the two routes' topk probes (`collect` of each forward)."""
    out = {}
    for L, a in cpu.items():
        if "topk" not in a:
            continue
        b = kern[L]
        marks = b.get("topk_tied") is not None
        kth_a, kth_b = a["topk_kth"], b.get("topk_kth")
        finite = torch.isfinite(kth_a)
        pool = a.get("candidate_pool")
        outside = 0
        if pool is not None:  # (a Reindex layer's picks outside its pool: top-ups; the source's own: not)
            picks = a["topk"]
            valid = picks >= 0
            outside = int((valid & ~pool.gather(-1, picks.clamp_min(0))).sum())
        out[str(L)] = {
            "picks_same": bool(torch.equal(a["topk"], b["topk"])),
            "kernel_marks": marks,
            "tied_same": marks and bool(torch.equal(a["topk_tied"], b["topk_tied"])),
            # the k-th scores to float32 rounding: the kernel and the CPU sum the same products in other orders
            "kth_same": marks and bool(torch.equal(finite, torch.isfinite(kth_b)))
                        and bool(torch.allclose(kth_a[finite], kth_b[finite], rtol=1e-4, atol=1e-5)),
            "tied": int(a["topk_tied"].sum()), "outside_pool_picks": outside}
    return out


def reference_on_kernels(cfg, weights, ids) -> dict:
    """TritonOps wrapping `reference` numerics against the CPU route of `reference`: with every kernel
    op handed back to the wrapped ops (bit for bit the same forward), and with every kernel (layer 0's
    attention mixes see the same bf16 inputs on both routes; later layers drift by the kernels' own
    precision)."""
    from engine.ops import ops_for
    from engine.ops.triton import TritonOps

    kinds = {"topk", "mhc", "routing"}
    cpu_logits, cpu = _probed(cfg, weights, ids, ops_for("reference"), kinds)
    wrapped = TritonOps(ops_for("reference"), weights, "cpu")
    handed_back = ("linear", "gemm_of", "rms_norm", "sparse_attention", "routed_experts", "index_topk", "mhc_attention",
                   "mhc_ffn", "rotate", "f32_linear", "expand",
                   "fp8_roundtrip", "quantize_fp8", "quantize_fp4_with_values",
                   "tie_marks", "engram_mix", "swiglu", "add", "route_topk")
    for name in handed_back:  # on the instance: every op the kernels take goes to the wrapped numerics
        setattr(wrapped, name, getattr(wrapped.base, name))
    same_logits, same = _probed(cfg, weights, ids, wrapped, kinds)
    ops = TritonOps(ops_for("reference"), weights, "cpu")
    logits, kern = _probed(cfg, weights, ids, ops, kinds)
    mix = kern[0]["mhc"]["attn"]
    return {
        "numerics": ops.name, "calls": dict(ops.calls), "finite": bool(torch.isfinite(logits).all()),
        "handed_back_bits": bool(torch.equal(same_logits, cpu_logits))
                            and all(torch.equal(same[L]["topk"], cpu[L]["topk"]) for L in cpu if "topk" in cpu[L]),
        "handed_back_calls": dict(wrapped.calls),
        "layer0_mixes_rel": max(rel(mix[k], cpu[0]["mhc"]["attn"][k]) for k in ("pre", "post", "comb")),
        "layer0_routing": near_ties_or_error(kern[0]["routing"], cpu[0]["routing"],
                                             weights.get("layers.0.ffn.gate.bias").float()),
        "topk_identical": {str(L): float((kern[L]["topk"] == cpu[L]["topk"]).all(-1).float().mean())
                           for L in cpu if "topk" in cpu[L]},
        "kernel_marks": {str(L): kern[L].get("topk_tied") is not None for L in cpu if "topk" in cpu[L]},
        "logits_rel_l2": rel(logits, cpu_logits), "grouped_out": grouped_out_on_kept_bf16(cfg, weights)}


def grouped_out_on_kept_bf16(cfg, weights) -> dict:
    """The kernel ops' wo_a product on the bf16 value they keep (never asking for the float weight)
    against the reference's einsum on the float weight, over every layer's wo_a."""
    from engine.ops import ops_for
    from engine.ops.triton import TritonOps

    ref, ops = ops_for("reference"), TritonOps(ops_for("reference"), weights, "cpu")
    d = cfg.n_heads // cfg.o_groups * cfg.head_dim
    o = torch.randn(5, cfg.o_groups, d, generator=torch.Generator().manual_seed(4))
    same, exact, asked = [], [], []

    def never():
        asked.append(True)
        raise AssertionError("the kernel ops asked for the float wo_a")

    for L in range(cfg.n_layers):
        name = f"layers.{L}.attn.wo_a"
        w = weights.get(name + ".weight")
        got, narrow = ops.grouped_out(o, never, name), ops.grouped_out(o, never, name, narrow=True)
        same.append(torch.equal(got, ref.grouped_out(o, lambda: w.view(cfg.o_groups, cfg.o_lora_rank, -1), name))
                    and narrow.dtype == torch.bfloat16 and narrow.is_contiguous() and torch.equal(narrow.float(), got))
        exact.append(torch.equal(ops._bf16_weight(name).float(), w))
    return {"same_bits": all(same), "kept_exact": all(exact), "asked": len(asked), "layers": cfg.n_layers}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from engine.checkpoint.writer import write_checkpoint
    from engine.checkpoint.weights import random_weights

    cfg = _config()
    ckpt = tmp_path_factory.mktemp("kp") / "ckpt"
    write_checkpoint(cfg, ckpt, random_weights(cfg, 0))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    logs = tmp_path_factory.mktemp("kp_logs")
    procs = {}
    for part in ("a", "b"):   # two halves at once: this process only waits
        with open(logs / f"{part}.out", "w") as stdout, open(logs / f"{part}.err", "w") as stderr:
            procs[part] = subprocess.Popen([sys.executable, __file__, str(ckpt), part], stdout=stdout,
                                           stderr=stderr, env=env, cwd=ROOT)
    merged, interpreted = {}, []
    try:
        for part, proc in procs.items():
            proc.wait(timeout=300)
            assert proc.returncode == 0, (logs / f"{part}.err").read_text()[-3000:]
            got = json.loads((logs / f"{part}.out").read_text().strip().splitlines()[-1])
            interpreted.append(got.pop("interpreter"))
            merged.update(got)
        merged["interpreter"] = all(v is True for v in interpreted)   # both halves ran interpreted
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return merged


# -- the tests --------------------------------------------------------------------------------------

def test_reference_run_calls_no_kernel(worker):
    assert worker["interpreter"] is True
    assert worker["ref_calls"] == {}


def test_fp32_kernels_in_the_forward_match_the_reference(worker):
    """mHC (tf32x3), the FP4 query quantizer (bit-exact), indexer scores (exact products) and the
    top-k: the whole forward agrees to float rounding and every layer picks the same entries."""
    got = worker["fp32_kernels"]
    assert {"mhc", "quantize_fp4", "indexer_scores", "topk_positions"} <= set(got["calls"])
    assert "fp8_linear" not in got["calls"] and "sparse_attn" not in got["calls"]
    assert got["finite"]
    assert got["rel_l2"] < 1e-4, got
    assert all(v == 1.0 for v in got["topk_identical"].values()), got["topk_identical"]


def test_the_kernel_route_marks_ties_as_the_cpu_route(worker):
    """Indexer.settle on the kernels' scores: the same picks, the same tied picks and k-th scores (to
    float rounding of the scores) as the CPU route, on layers where ties happen (scores tie at 0, after
    the ReLU); the kernel route used to give no marks at all."""
    got = worker["ties"]["fp32"]
    assert set(got) == {"2", "3", "4", "5", "6", "7"}
    for layer, row in got.items():
        assert row["kernel_marks"] and row["picks_same"] and row["tied_same"] and row["kth_same"], (layer, row)
    assert sum(row["tied"] for row in got.values()) > 0, got   # not a case without ties


def test_the_kernel_route_tops_up_a_short_pool_as_the_cpu_route(worker):
    """With the pool top-up on (as `reference` numerics), a Reindex query whose pool holds fewer than
    index_topk visible entries also takes visible entries outside it, on the kernel route as on the CPU
    route (the kernels' top-k takes pool entries only: the short rows are re-taken by settle)."""
    got = worker["ties"]["top_up"]
    assert got["7"]["outside_pool_picks"] > 0, got["7"]            # the top-up happened
    assert worker["ties"]["fp32"]["7"]["outside_pool_picks"] == 0  # and only with it on
    for layer, row in got.items():
        assert row["kernel_marks"] and row["picks_same"] and row["tied_same"] and row["kth_same"], (layer, row)


def near_ties_or_error(kern: dict, cpu: dict, bias) -> str:
    """check_same_experts_but_near_ties as a JSON value: "ok" or why not."""
    try:
        check_same_experts_but_near_ties(kern, cpu, bias)
    except AssertionError as err:
        return f"differs beyond near ties: {err}"
    return "ok"


def test_kernel_ops_wrapping_reference_numerics(worker):
    """TritonOps over `reference` numerics: with its kernel ops handed back to the wrapped ops it is the
    CPU reference bit for bit (it adds nothing of its own); with every kernel, layer 0's attention mixes
    (the same bf16 inputs on both routes) agree to the mHC kernel's tf32x3 precision, layer 0 routes the
    same but at most one near tie, the first Full layer picks the same, and every picking layer carries
    tie marks."""
    got = worker["reference_kernels"]
    assert got["numerics"] == "reference" and got["finite"]
    assert set(got["calls"]) == {"fp8_linear", "sparse_attn", "moe_fp4", "mhc", "quantize_fp4", "indexer_scores",
                                 "topk_positions", "rms_norm", "rope", "mhc_expand", "fp8_roundtrip", "quantize_fp8",
                                 "tie_marks", "engram_mix", "swiglu", "add", "route_topk"}
    assert got["handed_back_bits"] and got["handed_back_calls"] == {}, got
    assert got["layer0_mixes_rel"] < 1e-5, got
    assert got["layer0_routing"] == "ok", got["layer0_routing"]
    assert got["topk_identical"]["2"] == 1.0, got["topk_identical"]
    assert all(got["kernel_marks"].values()), got["kernel_marks"]
    # wo_a: the reference's bf16 product, bit for bit, on the kept bf16 value (the float weight never made)
    wo_a = got["grouped_out"]
    assert wo_a["same_bits"] and wo_a["kept_exact"] and wo_a["asked"] == 0, wo_a
    assert wo_a["layers"] == _config().n_layers, wo_a


def test_all_kernels_in_the_forward_stay_within_bf16_noise(worker):
    """With every kernel, the logits differ from the reference by about what rounding the
    reference's own linear outputs to bf16 does (the quantized model amplifies any bf16-size change:
    FP8/FP4 rounding and top-k decisions flip). Stated tolerance: at most 2x that change."""
    got, noise = worker["all_kernels"], worker["bf16_reference"]
    assert set(got["calls"]) == {"fp8_linear", "sparse_attn", "moe_fp4", "mhc", "quantize_fp4", "indexer_scores",
                                 "topk_positions", "rms_norm", "fp8_roundtrip", "quantize_fp8",
                                 "tie_marks", "engram_mix", "swiglu", "add", "route_topk"}  # fp32: their own rotation
    assert got["finite"]
    assert got["rel_l2"] <= 2 * noise["rel_l2"], (got, noise)
    # the first Full layer's selections are taken before most of the drift
    assert got["topk_identical"]["2"] >= 0.75, got["topk_identical"]


def test_prompt_attention_runs_the_two_passes_bf16x2_form_within_bf16_noise(worker):
    """By default every sparse attention call of a prompt (no decode-sized call) takes the two passes' bf16x2
    form, and the forward stays as close to the reference as with the one-pass kernel (knob attn_one_pass,
    which runs no two-pass call)."""
    got, noise, one_pass = worker["all_kernels"], worker["bf16_reference"], worker["attn_one_pass"]
    assert got["forms"] == ["bf16x2"] and got["two_pass_calls"] == got["calls"]["sparse_attn"] > 0
    assert one_pass["two_pass_calls"] == 0 and one_pass["calls"]["sparse_attn"] == got["calls"]["sparse_attn"]
    for run in (got, one_pass):
        assert run["finite"] and run["rel_l2"] <= 2 * noise["rel_l2"], (run, noise)
        assert run["topk_identical"]["2"] >= 0.75, run["topk_identical"]
    assert got["rel_l2"] != one_pass["rel_l2"]  # the two forms' roundings differ: the knob took effect


def test_hooks_pass_the_engines_operands(worker):
    """The kernels' references on what the hooks captured reproduce the engine's own computation:
    FP8 linears to bf16 output rounding; routed experts (given the engine's routing probe, the reference's
    numerics: FP8 x and w * h, bf16 roundings) to float rounding. A wrong routing weight, expert id or
    scale layout is far outside these bounds."""
    got = worker["hook_operands"]
    assert len(got) == 9, got
    for case, r in got.items():
        assert r < (1e-5 if case == "moe_fp4" else 5e-3), (case, r)


def test_layer_parity_rows(worker):
    for layer, rows in worker["parity"].items():
        kernels = {r["kernel"] for r in rows}
        assert kernels == {"mhc", "fp8_linear", "quantize_fp4", "indexer_scores", "indexer_topk", "sparse_attn",
                           "moe_fp4"}, (layer, kernels)
        for r in rows:
            assert r["ok"], (layer, r)
            assert r["rel_l2"] == r["rel_l2"] and r["rel_l2"] <= max(r["bound"], 0.0) + 1e-12, (layer, r)
        # the capture is the layer's real inputs: 7 FP8 linears (q_a, q_b, wkv, index q_b, wo_b, shared w1/w3/w2)
        assert sum(r["kernel"] == "fp8_linear" for r in rows) == 8
        assert [r["case"] for r in rows if r["kernel"] == "mhc"] == ["attention mixes", "FFN mixes + attention update"]
    assert {r["case"] for r in worker["parity"]["7"] if r["kernel"] == "indexer_scores"} == {"pool-masked"}
    assert all("(rows 12-15 of 16)" in r["case"] for r in worker["parity_rows"])


def test_default_cpu_path_imports_no_kernels(tmp_path):
    """kernels=None on the CPU: the forward never reaches kernels.dispatch (triton is not even imported)."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
from engine_helpers import tiny_model, random_ids
m = tiny_model()
with torch.inference_mode():
    m.forward(random_ids(m.cfg, 8))
assert m.ops.kernels is False and not hasattr(m.ops, "base")
print(sorted(k for k in sys.modules if k == 'triton' or k.startswith('kernels')))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_decide_rules(tmp_path):
    from engine.ops import triton as K
    from engine.checkpoint.weights import TensorWeights

    class Ckpt:  # stands for CheckpointWeights: what matters is a reader of stored bytes
        reader = object()

    mem = TensorWeights({})
    # training: in-memory (nn.Parameter) weights keep the reference path on CUDA too
    assert K.decide(None, mem, "cuda") is False
    assert K.decide(None, Ckpt(), "cpu") is False
    assert K.decide(None, Ckpt(), "cuda") is K.triton_importable()
    assert K.decide(None, Ckpt(), "cuda", parallel=object()) is False
    assert K.decide(False, Ckpt(), "cuda") is False
    assert K.decide(True, Ckpt(), "cpu") is True
    with pytest.raises(K.KernelPathError, match="in-memory"):
        K.decide(True, mem, "cuda")
    with pytest.raises(K.KernelPathError, match="must be a ShardedWeights"):
        K.decide(True, Ckpt(), "cuda", parallel=object())

    class RankShard(Ckpt):  # stands for ShardedWeights: a rank's slices in the stored formats
        parallel = object()

        def stored(self, name):
            return None

    assert K.decide(None, RankShard(), "cuda", parallel=RankShard.parallel) is K.triton_importable()
    assert K.decide(True, RankShard(), "cpu", parallel=RankShard.parallel) is True


def test_parity_view_rows_and_modes(worker):
    from explorer import layer_views as lv

    rows = worker["parity"]["7"]
    table = lv.parity_table(rows)
    assert [list(r) for r in table] == [list(lv.PARITY_COLUMNS)] * len(rows)
    assert all(r["verdict"] == "within bound" for r in table)
    assert "All" in lv.parity_summary(rows)
    bad = [dict(rows[0], ok=False, rel_l2=float("inf"))]
    assert lv.parity_table(bad)[0]["verdict"] == "OVER bound" and lv.parity_table(bad)[0]["rel L2"] == "inf"
    assert "OVER" in lv.parity_summary(bad)
    with pytest.raises(lv.ProbeError):
        lv.parity_table([{"kernel": "mhc"}])
    assert lv.parity_mode(True, False, 1e12, 2e9, 16)[0] == "cuda"
    mode, why = lv.parity_mode(False, True, 1e12, 2e9, 16)
    assert mode == "none" and "needs CUDA" in why
    assert lv.parity_mode(False, False, 1.0, 2e9, 16)[0] == "none"
    assert lv.parity_mode(False, True, 1e6, 2e9, 16)[0] == "interpreter"


def test_f32_linear_splits_k_at_decode_widths():
    """TritonOps.f32_linear (the compressor's float32 projections): a K-split batched GEMM at decode widths,
    equal to the float64 product to float32 rounding; the tf32x3 kernel at prefill widths; the wrapped op's for
    short K."""
    from engine.ops.fp32 import Fp32Ops
    from engine.ops.triton import TritonOps, _k_splits

    g = torch.Generator().manual_seed(11)
    ops = TritonOps.__new__(TritonOps)
    ops.base, ops.compute, ops.calls, ops.device = Fp32Ops(), True, Counter(), torch.device("cpu")
    x, w = torch.randn(64, 5120, generator=g).bfloat16().float(), torch.randn(96, 5120, generator=g).bfloat16()
    assert _k_splits(5120) == 16
    got, want = ops.f32_linear(x, w), (x.double() @ w.double().t())
    assert got.dtype == torch.float32 and got.shape == (64, 96)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    # a prefill's: the tf32x3 kernel (interpreted where the interpreter is on, else its float32 reference)
    wide = torch.randn(300, 5120, generator=g)
    got, want = ops.f32_linear(wide, w), wide.double() @ w.double().t()
    assert ops.calls["f32_gemm"] == 1 and ((got.double() - want).norm() / want.norm()).item() < 1e-6
    assert torch.equal(ops.f32_linear(x[:, :200], w[:, :200]), Fp32Ops().f32_linear(x[:, :200], w[:, :200]))


def test_bf16_linear_keeps_one_bf16_copy_per_weight():
    """TritonOps.bf16_linear over `reference` numerics: the wrapped op's bits, with the weight's bf16 copy made
    once per weight (not per call) and dropped with the weight."""
    import gc

    from engine.ops.reference import ReferenceOps
    from engine.ops.triton import TritonOps

    g = torch.Generator().manual_seed(12)
    ops = TritonOps.__new__(TritonOps)
    ops.base, ops.compute, ops._of_weight = ReferenceOps(), True, {}
    x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)
    want = ReferenceOps().bf16_linear(x, w)
    assert torch.equal(ops.bf16_linear(x, w), want) and torch.equal(ops.bf16_linear(x, w), want)
    assert len(ops._of_weight) == 1
    copy = ops._of_weight[id(w)][1]["bf16 copy"]
    ops.bf16_linear(x, w)
    assert ops._of_weight[id(w)][1]["bf16 copy"] is copy  # kept, not remade
    key = id(w)
    del w
    gc.collect()
    assert key not in ops._of_weight  # the copy went with the weight
    w2 = torch.randn(32, 64, generator=g)  # may reuse the id: the dead weight's copy must not be used
    assert torch.equal(ops.bf16_linear(x, w2), ReferenceOps().bf16_linear(x, w2))


def test_fp8_linears_above_a_decode_step_take_the_bf16_form():
    """TritonOps._bf16_form: the FP8 linear's bf16 tensor-core form above 64 rows, where K is whole 64 blocks
    and every scale byte is in its range (decided once a weight); a decode step's rows keep the FP8 form."""
    from engine.ops.triton import TritonOps
    from kernels.fp8_linear import BF16_MAX_SCALE_BYTE

    ops = TritonOps.__new__(TritonOps)
    ops._bf16_fits = {}
    scales = torch.full((2, 4), 120, dtype=torch.uint8)
    high = scales.clone()
    high[1, 2] = BF16_MAX_SCALE_BYTE + 1
    w = torch.zeros(64, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ops._raw = {"fits": (w, scales.view(torch.float8_e8m0fnu)), "high": (w, high.view(torch.float8_e8m0fnu)),
                "odd": (w[:, :96], scales[:, :3].view(torch.float8_e8m0fnu))}
    assert not ops._bf16_form("fits", 64) and ops._bf16_form("fits", 65) and ops._bf16_form("fits", 4096)
    assert not ops._bf16_form("high", 4096) and not ops._bf16_form("odd", 4096)
    assert ops._bf16_fits == {"fits": True, "high": False, "odd": False}
    # a decode step's wide products (K >= 4096, N >= 2048) take it too, unless the knob is off
    wide = torch.zeros(2048, 4096, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ops._raw["wide"] = (wide, torch.full((64, 128), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert ops._bf16_form("wide", 64) and ops._bf16_form("wide", 1) and not ops._bf16_form("fits", 64)
    assert ops.set_knobs("linear_bf16_decode=0, moe_fp8_mma=1") == {"linear_bf16_decode": False, "moe_fp8_mma": True}
    ops.set_knobs("attn_wgmma=0")  # the one attention knob on by default
    assert ops._attn_launch(()) == {}  # every attention knob off: the wrapper's own choices, nothing looked at
    assert not ops._bf16_form("wide", 64) and ops._bf16_form("wide", 65)
    for bad in ("linear_bf16_decode=yes", "moe_fp8_mma=2", "linear_bf16_decode=1,no_such_knob=1"):
        with pytest.raises(ValueError, match="knob"):
            ops.set_knobs(bad)
    assert not ops.linear_bf16_decode and ops.moe_fp8_mma  # a refused spec sets none of its knobs


if __name__ == "__main__":
    from triton_interp import speed_up   # tests/triton_interp.py: the same kernels, less interpreter overhead
    speed_up()
    print(json.dumps(_worker(sys.argv[1], sys.argv[2])))


def test_index_queries_reach_the_quantizer_as_they_are():
    """TritonOps._index_inputs: bf16 queries (the narrowed wq_b output) go to the FP4 quantizer as they are at 16
    heads or more (no widening, no zero-width pad copy) and give the float32 route's bytes; fewer heads are
    zero-padded to the dot's 16 rows."""
    from engine.ops.triton import TritonOps, reference_fp4

    ops = TritonOps.__new__(TritonOps)
    ops.compute, ops.calls, ops.device, ops.capture_layer = True, Counter(), torch.device("cpu"), None
    seen = []
    ops._kernel = lambda name: (lambda x, *a: seen.append(x) or reference_fp4(x.float(), 32))
    g = torch.Generator().manual_seed(13)
    keys = (torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1))
    for heads in (16, 4):
        q = torch.randn(3, heads, 64, generator=g).bfloat16()
        qp, qs, w, vis, _ = ops._index_inputs(2, q, torch.ones(3, heads), keys, torch.arange(3), None, 4, 2)
        assert seen[-1].dtype == torch.bfloat16 and seen[-1].shape == (3, 16, 64) and w.shape == (3, 16)
        assert (seen[-1].data_ptr() == q.data_ptr()) == (heads == 16)
        assert seen[-1][:, heads:].eq(0).all() and torch.equal(seen[-1][:, :heads], q)
        want_p, want_s = reference_fp4(torch.nn.functional.pad(q.float(), (0, 0, 0, 16 - heads)), 32)
        assert torch.equal(qp, want_p) and torch.equal(qs.view(torch.uint8), want_s.view(torch.uint8))
