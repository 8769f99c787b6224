"""The register-operand MoE form (kernels/moe_rs.py): the K order its A fragments imply, the activation's and the
hidden state's columns in that order (the kernel itself runs on a Hopper GPU only: tests/test_kernels_moe_ws.py)."""

from interpreted import interpreted  # noqa: F401 (first: the interpreter before triton, as the kernel tests run)

import torch
import triton
import triton.language as tl

from kernels import moe_rs


def test_rs_order_is_what_each_thread_decodes():
    """wgmma's A fragment (sm_90, bf16): lane (group g, quad q) holds K = 2q + r0 + 8 r2 + 16 r3 + 32 r4 of rows g
    and g + 8 (registers r). The thread decodes words 2q + r4 of its rows; a word's pair p is NIB columns 2p, 2p + 1
    of the word's 8: so MMA position K holds stored column 8 (2q + r4) + 2 (r2 + 2 r3) + r0."""
    seen = set()
    for q in range(4):
        for r0, r2, r3, r4 in ((a, b, c, d) for a in (0, 1) for b in (0, 1) for c in (0, 1) for d in (0, 1)):
            k = 2 * q + r0 + 8 * r2 + 16 * r3 + 32 * r4
            stored = 8 * (2 * q + r4) + 2 * (r2 + 2 * r3) + r0
            assert moe_rs.RS_ORDER[k] == stored == moe_rs.rs_position(k)
            seen.add(stored)
    assert seen == set(range(64))  # a permutation: every stored column once
    # a thread's two words are one 32-group (one E8M0 byte): columns 16 q .. 16 q + 15
    for k in range(64):
        assert moe_rs.RS_ORDER[k] // 32 == (k >> 2 & 1)


def test_rs_columns_put_each_step_in_mma_order():
    x = torch.arange(3 * 192, dtype=torch.float32).view(3, 192)
    got = moe_rs.rs_columns(x)
    for row in range(3):
        for col in range(192):
            assert got[row, col] == x[row, (col // 64) * 64 + moe_rs.RS_ORDER[col % 64]]


@triton.jit
def _h_columns_kernel(out_ptr, N: tl.constexpr):
    n = tl.arange(0, N)
    tl.store(out_ptr + n, moe_rs.rs_h_column(n))


def test_h_is_stored_where_the_down_gemm_reads_it():
    """The gate/up's column for hidden index n: the down GEMM's MMA position whose stored (NIB) column is n's, so
    h in that order is rs_columns of h in NIB order."""
    n = 2304
    cols = torch.empty(4096, dtype=torch.int32)
    _h_columns_kernel[(1,)](cols, N=4096)
    cols = cols[:n].tolist()
    assert sorted(cols) == list(range(n))
    nib = [(i & -8) | ((i & 3) << 1) | ((i >> 2) & 1) for i in range(n)]  # fp4_tiles.nib_position, by hand
    for i, c in enumerate(cols):
        assert (c & -64) | moe_rs.RS_ORDER[c & 63] == nib[i]
    h_nib = torch.zeros(1, n)
    h_nib[0, nib] = torch.arange(n, dtype=torch.float32)
    h_rs = torch.zeros(1, n)
    h_rs[0, cols] = torch.arange(n, dtype=torch.float32)
    assert torch.equal(moe_rs.rs_columns(h_nib), h_rs)


# the layouts the Gluon forms read the raw TMA boxes through, as Triton's own linear layouts (compiled for sm_90
# in a child process: the interpreter has no Gluon)
_VIEWS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from benches import compile_sm90 as bench
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from kernels import moe_ws
driver.set_active(bench.Sm90Driver())
JITFunction.run = bench.compile_only

@gluon.jit
def views(x_ptr):
    gl.static_print("WORDS", gl.to_linear_layout(moe_ws.PLAIN3, [64, 2, 4]))
    gl.static_print("BYTES", gl.to_linear_layout(moe_ws.PLAIN2, [2, 64]))

views[(1,)](torch.zeros(4), num_warps=4)
"""


def test_raw_boxes_are_read_row_major(tmp_path):
    """An unswizzled TMA box lands row-major in shared memory; the views the Gluon forms load the raw words and E8M0
    bytes through must be row-major too (triton 3.6 read an unswizzled 8-bit NVMMA view of the bytes otherwise, and
    both forms' values were wrong on the GPU, run 37a): each offset bit is the next column bit, then the rows'."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tests.triton_interp import env_without_interpreter

    repo = str(Path(__file__).resolve().parent.parent)
    script = tmp_path / "views.py"  # a file: Triton reads a jit function's source
    script.write_text(_VIEWS)
    env = dict(env_without_interpreter(), TRITON_CACHE_DIR=str(tmp_path / "cache"))  # compiled, so printed, here
    run = subprocess.run([sys.executable, str(script), repo], env=env, capture_output=True, text=True, cwd=repo,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    for name, shape in (("WORDS", [64, 2, 4]), ("BYTES", [2, 64])):
        line = next(x for x in run.stdout.splitlines() if x.startswith(name))
        offsets = line.split("offset_bases=")[1].split("block_bases")[0]
        bases = [list(map(int, b.split(","))) for b in re.findall(r"\[(-?\d+(?:, -?\d+)+)\]", offsets)]
        want = []
        for dim in reversed(range(len(shape))):  # the last dimension's bits first
            want += [[1 << b if d == dim else 0 for d in range(len(shape))] for b in range(shape[dim].bit_length() - 1)]
        assert bases[:len(want)] == want, (name, bases)


def test_shapes_the_form_cannot_take_are_refused_before_a_launch():
    """K must be whole pairs of 64-wide steps and the tile's weight rows whole 64-row MMAs: named, before any
    descriptor or launch; and moe_fp4_triton refuses the form where it cannot run (the interpreter here)."""
    import pytest

    from kernels import moe, moe_ws

    def call(kdim, rows, block_n, **form):
        w = torch.zeros(2 * rows, kdim // 2, dtype=torch.int8)
        s = moe_ws.transposed_scales(torch.zeros(2 * rows, kdim // 32, dtype=torch.uint8), 2)
        blocks = (torch.zeros(1, dtype=torch.int32),) * 3
        moe_rs.grouped_rs(torch.zeros(8, kdim, dtype=torch.bfloat16), [w], [s], torch.zeros(8, dtype=torch.int32),
                          blocks, torch.zeros(8, 64), 64, block_n=block_n, **form)

    with pytest.raises(ValueError, match="K 192 by 128"):
        call(192, 64, 64)
    with pytest.raises(ValueError, match="block_n 32"):
        call(256, 64, 32)
    with pytest.raises(ValueError, match="got 96"):
        call(256, 64, 64, stage_k=96)
    with pytest.raises(ValueError, match="got 1: one copy ahead"):  # a ring of one stage would wait forever
        call(256, 64, 64, stages=1)
    x = torch.zeros(4, 128).bfloat16()
    w, w2 = torch.zeros(2, 64, 64, dtype=torch.int8), torch.zeros(2, 128, 32, dtype=torch.int8)
    s, s2 = (torch.full((2, n, g), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu) for n, g in ((64, 4), (128, 2)))
    with pytest.raises(ValueError, match="engine's hidden state"):
        moe.moe_fp4_triton(x, w, s, w, s, w2, s2, torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2), ws="rs",
                           hidden="reference")
