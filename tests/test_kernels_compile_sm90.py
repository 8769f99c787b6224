"""Every Triton kernel compiles for the H200 (sm_90) with the Triton installed here, at the release's
widths, without spilling in the cases that must not: the interpreter tests run the kernels' Python,
not Triton's compiler, so a kernel can pass them and still fail to build on the GPU (a module global
read inside a kernel without `tl.constexpr` did). benches/compile_sm90.py does the compiling (no GPU
needed: ptxas ships with Triton); it runs in a child process because it replaces Triton's driver."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# found without importing triton: importing it here, before the interpreter tests set
# TRITON_INTERPRET=1 at their import, would leave their kernels compiled-mode functions
_SPEC = importlib.util.find_spec("triton")
PTXAS = Path(_SPEC.origin).parent / "backends" / "nvidia" / "bin" / "ptxas" if _SPEC and _SPEC.origin else None


@pytest.mark.skipif(PTXAS is None or not PTXAS.exists(), reason="Triton's ptxas is not installed")
def test_every_kernel_compiles_for_sm90(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "benches" / "compile_sm90.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=1200, cwd=REPO)
    table = (tmp_path / "compile-sm90.md").read_text() if (tmp_path / "compile-sm90.md").exists() else ""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Cases stopped" not in table
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [[c.strip() for c in r] for r in rows[1:]]
    cases = {r[0] for r in rows}
    for case in ("quantizers", "indexer + top-512 decode", "top-512 prefill", "sparse attention decode b64",
                 "MoE decode 1 token", "MoE prefill", "mHC 4K tokens", "mHC 1 token", "fp8 linear 64x5120x8192"):
        assert case in cases, case
    assert all(r[-1] == "ok" for r in rows)
    # the tensor-core cases use warpgroup MMA (Hopper's), not the older mma.sync path
    kernels = {(r[0], r[1]): r for r in rows}
    for case, kernel in (("fp8 linear 128x5120x8192", "_fp8_linear_kernel"), ("MoE prefill", "_moe_gate_up_kernel")):
        assert kernels[(case, kernel)][8] == "yes", (case, kernel)
    # the decode paths are the latency-critical ones: no spills there
    for r in rows:
        if "decode" in r[0] or "1 token" in r[0]:
            assert int(r[6]) == 0, r
    assert re.search(r"triton \d", table)
