"""Every Triton kernel compiles for the H200 (sm_90) with the Triton installed here, at the release's
widths, without spilling in the cases that must not: the interpreter tests run the kernels' Python,
not Triton's compiler, so a kernel can pass them and still fail to build on the GPU (a module global
read inside a kernel without `tl.constexpr` did). benches/compile_sm90.py does the compiling (no GPU
needed: ptxas ships with Triton); it runs in child processes because it replaces Triton's driver.

Compiling is CPU-bound and the test only waits, so the bench's cases run as two processes at once: the
two mHC cases (about half the cold compile time; last in the bench's order and built by no other case)
through the command line's `--only mHC`, and every other case through the bench's own main() with its
case list less those two. The two tables, rows in the bench's case order and a kernel built by both
kept once (as the bench's one run keeps it), are the table the bench writes in one run."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_interp import env_without_interpreter

REPO = Path(__file__).resolve().parent.parent
# found without importing triton: importing it here, before the interpreter tests set
# TRITON_INTERPRET=1 at their import, would leave their kernels compiled-mode functions
_SPEC = importlib.util.find_spec("triton")
PTXAS = Path(_SPEC.origin).parent / "backends" / "nvidia" / "bin" / "ptxas" if _SPEC and _SPEC.origin else None


# every case of the bench but the mHC ones, through its main() (as `python benches/compile_sm90.py --out DIR`)
ALL_BUT_MHC = """
import sys
from benches import compile_sm90 as bench
every = bench.cases
bench.cases = lambda: [(name, thunk) for name, thunk in every() if "mHC" not in name]
raise SystemExit(bench.main(["--out", sys.argv[1]]))
"""


def _rows(table: str) -> list[list[str]]:
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return [[c.strip() for c in r] for r in rows[1:]]


@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = env_without_interpreter()
    commands = {"rest": [sys.executable, "-c", ALL_BUT_MHC, str(tmp_path / "rest")],
                "mhc": [sys.executable, str(REPO / "benches" / "compile_sm90.py"), "--only", "mHC",
                        "--out", str(tmp_path / "mhc")]}
    procs = {}
    for part, command in commands.items():
        (tmp_path / part).mkdir()
        with open(tmp_path / f"{part}.log", "w") as log:
            procs[part] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        for proc in procs.values():
            proc.wait(timeout=1200)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tables = {}
    for part, proc in procs.items():
        path = tmp_path / part / "compile-sm90.md"
        tables[part] = path.read_text() if path.exists() else ""
        assert proc.returncode == 0, (tmp_path / f"{part}.log").read_text()[-6000:]
        assert "Cases stopped" not in tables[part]
    table = tables["rest"] + tables["mhc"]
    rows, seen = [], set()
    for r in _rows(tables["rest"]) + _rows(tables["mhc"]):   # the bench's order: the mHC cases come last
        if (r[1], r[2], r[3], r[4]) not in seen:             # kernel, constants, warps, stages: built once
            seen.add((r[1], r[2], r[3], r[4]))
            rows.append(r)
    cases = {r[0] for r in rows}
    for case in ("quantizers", "indexer + top-512 decode", "top-512 prefill", "sparse attention decode b64",
                 "MoE decode 1 token", "MoE prefill", "mHC 4K tokens", "mHC 1 token", "fp8 linear 64x5120x8192"):
        assert case in cases, case
    assert all(r[-1] == "ok" for r in rows)
    # the tensor-core cases use warpgroup MMA (Hopper's), not the older mma.sync path
    kernels = {(r[0], r[1]): r for r in rows}
    for case, kernel in (("fp8 linear 128x5120x8192", "_fp8_linear_kernel"), ("MoE prefill", "_moe_gate_up_kernel"),
                         ("MoE prefill, warp-specialized grouped GEMMs (Gluon)", "_moe_ws_kernel"),
                         ("MoE prefill, FP4 decoded into the wgmma's register operand (Gluon)", "_moe_rs_kernel"),
                         ("sparse attention prefill 4K, one pass on wgmma (Gluon)", "_sparse_attn_wgmma_kernel")):
        assert kernels[(case, kernel)][8] == "yes", (case, kernel)
    # the register-operand form's 64-token tiles hold the decoded tile in registers: no spill
    assert all(int(r[6]) == 0 for r in rows if r[1] == "_moe_rs_kernel" and "BM=64" in r[2]), "moe_rs spills"
    # the one-pass attention holds O (128 registers) under its MMAs and decodes the next tile beside it: no spill
    assert all(int(r[6]) == 0 for r in rows if r[1] == "_sparse_attn_wgmma_kernel"), "wgmma attention spills"
    # no kernel has its warpgroup MMAs serialized by ptxas (C7512: each waits for the last, e.g. for want of the
    # registers to keep a register operand live while it is in flight, as a 128-register cap does to moe_rs; C7515:
    # other instructions writing an in-flight MMA's accumulator, as the wgmma attention's first forms did)
    control = "MoE prefill, register operand capped at 128 registers (serialized)"
    assert not [r[:3] for r in rows if r[8] == "serialized" and r[0] != control]
    assert any(r[0] == control and r[1] == "_moe_rs_kernel" and r[8] == "serialized" for r in rows)
    # the decode paths are the latency-critical ones: no spills there, except the attention's one-pass
    # entries layout (the small decode calls' default; a 64-token batch takes the two passes, which do not
    # spill), which the H200 measured faster spilling than the heads layout without (67.9 vs 81.4 us,
    # benches/results/kernels-h200-run7.md): a bound on its spill, not a pass
    measured_faster_spilling = {"_sparse_attn_t_kernel": 256}
    # and the split path's filter without row lengths (a top-k call given none; the indexer's fused decode and the
    # engine's select pass them, and spill nothing): at 2,048 groups ptxas holds it to 80 registers of its own accord
    # and spills one register in the bound's search (one STL / LDL pair in its SASS; under a 128-register cap it
    # spills none, untimed): bounded at 4 B
    no_lengths_filter = 4
    for r in rows:
        if "decode" in r[0] or "1 token" in r[0]:
            bound = no_lengths_filter if r[1] == "_filter_kernel" and "HAS_LEN=False" in r[2] else 0
            assert int(r[6]) <= max(bound, measured_faster_spilling.get(r[1], 0)), r
    # GPU-scope fences (each a MEMBAR.ALL.GPU on sm_90, waiting for all of the thread's memory traffic): sums and
    # slot counters that only later launches read carry none (the grouped MoE down kernel had 16 a thread before
    # its adds were relaxed); a kernel whose last program to arrive reads the others' sums carries one, its counter's
    last_arriver = {"_gemv_gate_up_kernel", "_mhc_main_kernel"}
    for r in rows:
        counter = r[1] in last_arriver or (r[1] == "_gemv_down_kernel" and "hidden" in r[0])
        assert int(r[9]) <= counter, (r[0], r[1], r[9])
    assert any(r[0] == "MoE decode 1 token, the engine's hidden state" and r[1] == "_gemv_down_kernel" for r in rows)
    assert re.search(r"triton \d", table)


# cast_rne compiled for sm_90: the native round-to-nearest-even cast (cvt.rn), not the interpreter's bit form
CAST_PTX = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import triton
import triton.language as tl
from triton.runtime import driver
from benches import compile_sm90 as bench
driver.set_active(bench.Sm90Driver())
from kernels._formats import bf16_rne_bits, cast_rne

@triton.jit
def cast(x_ptr, y_ptr, BITS: tl.constexpr):
    i = tl.arange(0, 256)
    v = tl.load(x_ptr + i)
    tl.store(y_ptr + i, bf16_rne_bits(v) if BITS else cast_rne(v, tl.bfloat16))

for bits in (0, 1):
    k = cast.run(torch.empty(256), torch.empty(256, dtype=torch.bfloat16), BITS=bits, grid=(1,), warmup=True)
    print("PTX", bits, "cvt.rn.bf16" in k.asm["ptx"], "32767" in k.asm["ptx"])
"""


@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_compiled_bf16_rounding_is_the_native_cast(tmp_path):
    """Compiled, cast_rne is one cvt.rn a value (the bit form cost the mHC's chunk loop 1,426 SASS instructions
    against 1,019); the bit form stays for the interpreter (test_kernels_mhc checks it against torch's rounding)
    and the MoE's epilogues."""
    script = tmp_path / "cast_ptx.py"  # a file: Triton reads a jit function's source
    script.write_text(CAST_PTX)
    run = subprocess.run([sys.executable, str(script), str(REPO)], capture_output=True, text=True, cwd=REPO,
                         env=env_without_interpreter(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = {line.split()[1]: line.split()[2:] for line in run.stdout.splitlines() if line.startswith("PTX")}
    # both end in a cvt.rn (the bit form's of a value already rounded); only the bit form adds 0x7FFF
    assert found == {"0": ["True", "False"], "1": ["True", "True"]}, run.stdout[-2000:]


def test_global_stores_are_read_by_width(monkeypatch):
    """The census's store column against a hand-written SASS listing: predicated stores count, loads do not,
    a store without a width suffix is 32 bits."""
    sys.path.insert(0, str(REPO))
    # the bench's import drops TRITON_INTERPRET (its kernels must compile); monkeypatch puts this process's value
    # back afterwards, for the interpreter tests that run after this one here (a kernel module first imported
    # after it would otherwise be compiled, and launch with no driver)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))
    from benches.compile_sm90 import global_stores, sass_rows
    listing = "\n".join([
        "        /*0080*/                   STG.E.128 desc[UR4][R2.64], R4 ;",
        "        /*0090*/              @P0  STG.E.U16 desc[UR4][R2.64], R4 ;",
        "        /*00a0*/                   STG.E desc[UR4][R2.64], R4 ;",
        "        /*00b0*/             @!P1  STG.E.128 desc[UR4][R6.64], R8 ;",
        "        /*00c0*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",
        "        /*00d0*/                   STS.128 [R3], R4 ;"])
    rows = sass_rows(listing)
    assert [op for _, op, _ in rows] == ["STG.E.128", "STG.E.U16", "STG.E", "STG.E.128", "LDG.E.128", "STS.128"]
    assert global_stores(rows) == "1x16 1x32 2x128" and global_stores([]) == "-"


@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_the_experts_round_trip_stores_whole_vectors(tmp_path):
    """The E4M3 round trip in the FP4 decoders' nibble order (the routed experts' input) stores 128-bit vectors:
    the order made on the store's addresses compiled to sixteen 16-bit stores a thread, 136 against 17 us a launch
    (H100 runs 34a, 34b). Its SASS, compiled for sm_90 with the Triton installed here."""
    run = subprocess.run([sys.executable, str(REPO / "benches" / "compile_sm90.py"), "--only", "quantizers", "--sass",
                          "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         env=env_without_interpreter(), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    sass = (tmp_path / "compile-sm90.md").read_text().split("SASS census")[1]
    stores = {r[1]: r[-1] for r in _rows(sass)}
    assert set(stores["_fp8_roundtrip_kernel"].split()) == {"2x128"}, stores
