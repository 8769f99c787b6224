"""benches/release_layer.py as a CPU smoke test at the tiny config: every role's two rows through the kernel
ops (engine/ops/triton.py over the stored bytes; on the CPU without the interpreter they call the kernels'
references), the Triton versions under TRITON_INTERPRET=1 for the roles without a top-k (the interpreted
radix top-k takes minutes even at tiny shapes), and floors that follow from FLOPs and bytes counted by
hand for one layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interp import env_without_interpreter

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("swa", "swa_engram", "full_m2", "reuse", "full_m1", "reindex")
TOKENS, DECODE = 16, 2


# under the interpreter: the bench's main() after tests/triton_interp.py's speed-up (the same kernels)
INTERPRETED = """
import sys
sys.path.insert(0, sys.argv[1])
from triton_interp import speed_up
speed_up()
from benches import release_layer as bench
sys.exit(bench.main(sys.argv[2:]))
"""


def start_bench(out: Path, interpret: bool, *extra: str) -> subprocess.Popen:
    env = env_without_interpreter()
    args = ["--tiny", "--passes", "1", "--kernels", "on", "--tokens", str(TOKENS), "--decode", str(DECODE),
            "--out", str(out), *extra]
    if interpret:
        env["TRITON_INTERPRET"] = "1"
        command = [sys.executable, "-c", INTERPRETED, str(ROOT / "tests"), *args]
    else:
        command = [sys.executable, str(ROOT / "benches" / "release_layer.py"), *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_bench(out: Path, proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    data = json.loads((out / "release-layer.json").read_text())
    data["_stdout"], data["_rc"], data["_md"] = stdout + stderr, proc.returncode, (out / "release-layer.md").read_text()
    return data


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Both benches at once (the test process only waits): every role through the kernel ops on the CPU,
    and the Triton versions of the two roles without a top-k under the interpreter."""
    plain, interpreted = tmp_path_factory.mktemp("release_layer"), tmp_path_factory.mktemp("release_layer_interp")
    procs = [start_bench(plain, False, "--ops", "linear_bf16_decode=0"),  # a knob reaches the kernel ops
             start_bench(interpreted, True, "--roles", "swa,swa_engram")]
    try:
        return {"plain": finish_bench(plain, procs[0]), "interpreted": finish_bench(interpreted, procs[1])}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def report(reports):
    return reports["plain"]


def test_triton_versions_under_the_interpreter(reports):
    got = reports["interpreted"]
    assert [(r["role"], r["phase"], r["status"]) for r in got["rows"]] == \
        [(role, phase, "ok") for role in ("swa", "swa_engram") for phase in ("prefill", "decode")], got["_stdout"][-2000:]
    assert got["ops"].startswith("TritonOps") and got["_rc"] == 0


def test_every_role_has_a_prefill_and_a_decode_row(report):
    failed = [(r["role"], r.get("error")) for r in report["rows"] if r["status"] != "ok"]
    assert not failed, failed
    got = [(r["role"], r["phase"]) for r in report["rows"]]
    assert got == [(role, phase) for role in ROLES for phase in ("prefill", "decode")]
    assert report["ops"].startswith("TritonOps")  # the kernel ops ran (under the interpreter)
    assert report["ops"].endswith(", linear_bf16_decode=False")
    layers = {r["role"]: r["layer"] for r in report["rows"]}
    assert layers == {"swa": 0, "swa_engram": 1, "full_m2": 2, "reuse": 3, "full_m1": 5, "reindex": 7}
    chains = {r["role"]: r["chain"] for r in report["rows"]}
    assert chains["reuse"] == [2, 3] and chains["reindex"] == [5, 7]  # their sources run first
    md = report["_md"]
    assert sum(line.startswith("|") for line in md.splitlines()) == 2 + 2 * len(ROLES)  # header, rule, 2 per role
    assert report["_rc"] == 0, report["_stdout"][-2000:]


def test_swa_layer_floor_from_a_hand_count(report):
    """Layer 0 of the tiny config (dim 64, 4 heads of 64, q rank 32, 2 groups of rank 32, window 8,
    8 experts of 32, top-6 + 1 shared, 4 copies), prefill of 16 tokens."""
    row = next(r for r in report["rows"] if r["role"] == "swa" and r["phase"] == "prefill")
    linears = 2 * 16 * (64 * 32 + 32 * 256 + 64 * 64 + 256 * 32 + 64 * 64)   # wq_a wq_b wkv wo_a wo_b
    attention = 4 * 4 * 64 * (sum(range(1, 9)) + 8 * 8)                      # window min(8, p + 1)
    mhc = 2 * 2 * 16 * 256 * 24
    moe = 2 * 16 * 64 * 8 + 6 * 16 * 64 * 32 * 7                             # gate, 3 GEMMs x (1 + 6)
    assert row["flops"] == linears + attention + mhc + moe == 2740224
    # stored bytes of layer 0 without experts: norms 336, FP8 linears with scales 26650, FFN norm + gate
    # + biases 1216, shared expert 6150, mHC 2 x 24684; each expert 3 x 1088
    weights = 336 + 26650 + 1216 + 6150 + 2 * 24684
    assert weights == 83720
    touched = row["touched_experts"]
    assert 1 <= touched <= 8
    stream, window = 2 * 16 * 4 * 64 * 2, 16 * (64 + 2)
    assert row["bytes"] == weights + touched * 3264 + stream + window
    rates = report["rates"]
    want = max(row["flops"] / rates["fp8_flops"], row["bytes"] / rates["hbm_Bps"])
    assert row["floor_s"] == pytest.approx(want, rel=1e-12)
    assert row["limit"] == ("FP8" if row["flops"] / rates["fp8_flops"] >= row["bytes"] / rates["hbm_Bps"] else "HBM")
    assert row["ratio"] == pytest.approx(row["time_s"] / want, rel=1e-9)


def test_decode_counts_each_sequence_cache(report):
    """A decode step of 2 sequences at position 16 in the Full m=2 layer: each reads its window
    (8 rows of FP8 + scales), its 8 picks of the 8 visible entries and the 8 index keys, and writes
    one new entry (16 // 2 -> 17 // 2 does not complete a group: none)."""
    row = next(r for r in report["rows"] if r["role"] == "full_m2" and r["phase"] == "decode")
    parts = row["bytes_parts"]
    assert parts["window"] == 2 * 8 * (64 + 2)
    assert parts["global_kv"] == 2 * 8 * (32 + 4)
    assert parts["index_keys"] == 2 * 8 * (16 + 1)
    assert row["flops_parts"]["attention"] == 4 * 4 * 64 * 2 * (8 + 8)


def test_stored_weights_keep_no_float_copy_and_feed_the_fp8_kernel():
    """StoredWeights hands out an FP8 weight's value for the call only (nothing kept alive), and
    TritonOps.gemm_of runs the FP8 linear on the weight's stored bytes, never asking for that value."""
    import torch
    from engine import quant
    from engine.ops import ops_for
    from engine.ops.stored import StoredWeights, TensorReader
    from engine.ops.triton import TritonOps

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) / 10
    q, s = quant.quantize_fp8_weight(w, 32)
    src = StoredWeights(reader=TensorReader({"layers.0.engram.wkv.weight": q, "layers.0.engram.wkv.scale": s,
                                             "layers.0.norm.weight": torch.ones(8, dtype=torch.bfloat16)}))
    value = src.get("layers.0.engram.wkv.weight")
    assert torch.equal(value, quant.dequantize_fp8_weight(q, s, 32))
    assert src.get("layers.0.norm.weight").dtype == torch.float32
    assert src.stored_bytes() == 64 * 96 + 2 * 3 + 8 * 2 + 8 * 4  # stored bytes + the one widened BF16 weight
    ops = TritonOps(ops_for("fp32"), src, "cpu")
    x = quant.fp8_roundtrip(torch.randn(5, 96, generator=g), 32)
    # by name (the Engram's wkv): the kernel on the stored bytes, the float value never fetched
    fetched = []
    got = ops.gemm_of(x, lambda: fetched.append(1), "layers.0.engram.wkv.weight")
    assert fetched == [] and ops.calls["fp8_linear"] == 1
    want = x.double() @ value.double().t()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2  # bf16 output of the FP8 kernel
    other = torch.randn(8, 96, generator=g)
    assert torch.equal(ops.gemm_of(x, lambda: other, "layers.0.other.weight"), x @ other.t())  # not stored FP8
    del value
    import gc
    gc.collect()
    assert src._handed.alive() == 0  # nothing kept alive


def test_gemm_of_takes_the_bf16_form_where_linear_would(monkeypatch):
    """The Engram's wkv by name: above a decode step's rows (K whole 64 blocks, scales in range) the FP8 kernel
    runs in its bf16 form, as `linear` does (its products on cuBLAS by default, knob linear_cublas); at 64 rows of
    a narrow product, the FP8 form. Under `reference` the output is the kernel's bf16 tensor (its one reader, the
    Engram's mix, widens what it loads); under fp32 numerics float32. All equal the float64 product to bf16
    rounding."""
    import torch
    from engine import quant
    from engine.ops import ops_for
    from engine.ops.stored import StoredWeights, TensorReader
    from engine.ops.triton import TritonOps

    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g) / 10
    q, s = quant.quantize_fp8_weight(w, 32)
    name = "layers.1.engram.wkv.weight"
    ops = TritonOps(ops_for("reference"), StoredWeights(reader=TensorReader({name: q, "layers.1.engram.wkv.scale": s})),
                    "cpu")
    seen, kernel = [], ops._kernel

    def spy(kind):
        run = kernel(kind)
        return lambda *a, **k: seen.append(k) or run(*a, **k)

    monkeypatch.setattr(ops, "_kernel", spy)
    value = quant.dequantize_fp8_weight(q, s, 32).double()
    assert ops.linear_cublas
    for rows, form, cublas in ((65, {"mma": "cublas"}, True), (65, {"mma": "bf16"}, False), (64, {}, True)):
        ops.linear_cublas = cublas
        x = quant.fp8_roundtrip(torch.randn(rows, 128, generator=g), 32)
        got = ops.gemm_of(x, lambda: pytest.fail("the float weight was fetched"), name)
        assert seen.pop() == {"float_out": False, **form} and got.dtype == torch.bfloat16
        want = x.double() @ value.t()
        assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-12).all()
    fp32 = TritonOps(ops_for("fp32"), StoredWeights(reader=TensorReader({name: q, "layers.1.engram.wkv.scale": s})),
                     "cpu")
    monkeypatch.setattr(fp32, "_kernel", spy)
    got = fp32.gemm_of(x, lambda: pytest.fail("the float weight was fetched"), name)
    assert seen.pop() == {"float_out": True} and got.dtype == torch.float32
    assert torch.equal(got, got.bfloat16().float())  # bf16 values


def test_profile_pass_writes_a_section_per_phase(tmp_path):
    """--profile: after the timed passes, one more pass under torch.profiler; each role's two phases get
    a section in release-layer-profile.txt, and the JSON keeps the sums, not the tables."""
    data = finish_bench(tmp_path, start_bench(tmp_path, False, "--roles", "swa,reuse", "--passes", "2", "--profile"))
    assert data["_rc"] == 0, data["_stdout"][-2000:]
    text = (tmp_path / "release-layer-profile.txt").read_text()
    for title, layer in (("SWA-only", 0), ("Reuse", 3)):
        for phase, n in (("prefill", TOKENS), ("decode", DECODE)):
            assert f"## {title}, layer {layer}, {phase} {n}:" in text
    assert text.count("## ") == 4 and "Self CPU time total" in text
    rows = [r for r in data["rows"] if r["status"] == "ok"]
    assert len(rows) == 4 and all(set(r["profile"]) == {"kernel_s", "busy_s", "span_s", "launches"} for r in rows)


def test_graph_row_and_table_judge_the_back_to_back_replay():
    """A row's graph figures: the goal is judged on the back-to-back replay; the single replay is shown
    beside it; an error row keeps the table's columns."""
    import torch
    from benches.release_graph import graph_row, graph_table
    eager = torch.tensor([1.0, -2.0])
    graph = {"graph_s": 2.9e-3, "graph_single_s": 3.4e-3, "graph_out": eager + 0.02, "graph_peak": 1}
    row = graph_row(graph, eager, floor_s=1e-3)
    assert row["graph_ratio"] == pytest.approx(2.9) and row["graph_goal_met"]
    assert row["graph_rel_diff"] == pytest.approx(0.01)
    assert not graph_row({**graph, "graph_s": 3.1e-3}, eager, 1e-3)["graph_goal_met"]  # 3.1x
    base = {"status": "ok", "phase": "decode", "queries": 64, "title": "SWA-only", "layer": 0, "time_s": 9e-3}
    prefill = {**base, "phase": "prefill", "queries": 4096, "time_s": 20e-3}
    lines = graph_table([{**prefill, **graph_row({**graph, "graph_s": 9e-3}, eager, floor_s=2e-3)}, prefill,
                         {**base, **row}, {**base, "graph_error": "RuntimeError: capture failed"}])
    # decode rows first, then the graphed prefill (4.5x its floor); a prefill row without a graph pass is left out
    assert lines[-3].startswith("| SWA-only | 0 | decode 64 | 9.00 | 2.900 | 3.400 | 2.9 | met | 1.0e-02 | none |")
    assert lines[-2].count("|") == lines[-3].count("|") and "capture failed" in lines[-2]
    assert lines[-1].startswith("| SWA-only | 0 | prefill 4096 | 20.00 | 9.000 | 3.400 | 4.5 | missed | 1.0e-02 |")


def test_prefill_rows_name_their_host_syncs():
    """A prefill row's host syncs (CUDA's sync debug mode, on a pass of their own) go in its note; a decode
    row's go in the graph table, not the note. A profiled row's note gives its kernel time and GPU idle."""
    from benches.release_graph import table
    row = {"status": "ok", "title": "Full m=2", "layer": 2, "queries": 4096, "time_s": 0.03, "flops": 3e12,
           "bytes": 7e9, "floor_s": 2e-3, "limit": "FP8", "ratio": 15.0, "goal_met": False, "peak_bytes": 1e10,
           "touched_experts": 384, "warm": True, "chain": [2]}
    report = {"rates": {"fp8_gemm_n": 8192, "fp8_flops": 1.4e15, "hbm_Bps": 4.2e12}, "device": "H200", "config": "c",
              "tokens": 4096, "decode": 64, "weights": "stored", "ops": "TritonOps", "wall_s": 1.0, "budget_s": 2,
              "rows": [{**row, "phase": "prefill", "host_syncs": ["reference.py:194", "engram.py:241"]},
                       {**row, "phase": "decode", "queries": 64, "host_syncs": ["reference.py:194"],
                        "profile": {"kernel_s": 3.1e-3, "busy_s": 3.0e-3, "span_s": 10.25e-3}}]}
    lines = [line for line in table(report).splitlines() if line.startswith("| Full m=2 | 2 |")]
    assert lines[0].endswith("chain [2]; host syncs reference.py:194, engram.py:241 |")
    assert "host syncs" not in lines[1]
    # a profiled row says how much of its GPU span was idle (10.25 - 3.0 ms)
    assert lines[1].endswith("chain [2]; profiled: kernels 3.10 ms, GPU idle 7.25 of 10.25 ms |")


def test_knob_ab_times_the_defaults_beside_each_variant_and_restores_the_knobs():
    """--ab: the defaults first, then each variant (a compiling pass, then each phase as a graph where one is
    captured, else its eager time on a pass after the compiling one), the knobs set back after every variant, a refused spec its own row; the
    table gives each variant's ratio to the defaults measured in the same process."""
    from benches.release_graph import ab_table, knob_ab
    from engine.ops.triton import TritonOps

    class Ops:  # the knobs as TritonOps keeps and sets them
        KNOBS = ("fast", "other")
        fast, other = True, False
        set_knobs = TritonOps.set_knobs

    ops, seen = Ops(), []

    def run_pass(graphs=None):
        seen.append((ops.fast, ops.other, None if graphs is None else next(iter(graphs))))
        took = 0.01 if ops.fast else 0.02
        if graphs is not None and "prefill" in graphs:  # only the prefill captures (the decode: eager)
            graphs["prefill"]["graph_s"] = took / 2
        return {"prefill_s": took, "decode_s": took / 10}

    ab = knob_ab(ops, ["fast=0,other=1", "nope=1"], run_pass)
    assert [v["knobs"] for v in ab] == ["defaults", "fast=0,other=1", "nope=1"]
    assert ab[0] == {"prefill": 0.005, "prefill_how": "graph", "decode": 0.001, "decode_how": "eager",
                     "knobs": "defaults"}
    assert ab[1]["prefill"] == 0.01 and ab[1]["decode"] == 0.002 and "unknown" in ab[2]["error"]
    assert (ops.fast, ops.other) == (True, False)  # restored
    # the variant's passes: its compiles, each phase's capture, then the uncaptured decode timed on a later pass
    assert seen[4:8] == [(False, True, None), (False, True, "prefill"), (False, True, "decode"), (False, True, None)]
    lines = ab_table([{"status": "ok", "title": "Reuse", "ab": ab}])
    assert lines[-2] == "| Reuse | fast=0,other=1 | 10.000 | 2.000 | 2.000 | 2.000 | graph / eager |"
    assert "unknown kernel-ops knob" in lines[-1]
    assert "has no knobs" in knob_ab(object(), ["fast=0"], run_pass)[0]["error"]


def test_a_failed_role_does_not_stop_the_report(tmp_path):
    """A role's error row (no phase, no figures) is written with the others: the profile text skips it (it had
    raised a KeyError in write(), losing every role's report)."""
    from benches.release_layer import write
    rates = {"fp8_gemm_n": 8192, "fp8_flops": 1.4e15, "hbm_Bps": 4.2e12}
    report = {"rates": rates, "device": "H200", "config": "c", "tokens": 4096, "decode": 64, "weights": "stored",
              "ops": "TritonOps", "wall_s": 1.0, "budget_s": 2,
              "rows": [{"role": "reuse", "title": "Reuse", "layer": 3, "status": "error", "error": "RuntimeError: x"}]}
    write(report, tmp_path)
    assert "RuntimeError: x" in (tmp_path / "release-layer.md").read_text()
    assert json.loads((tmp_path / "release-layer.json").read_text())["rows"][0]["status"] == "error"
