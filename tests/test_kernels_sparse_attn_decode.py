"""Sparse attention, layout="heads_chunked" (kernels/sparse_attn.py, _sparse_attn_c_kernel: heads as M, D in
four chunks) under TRITON_INTERPRET=1 against the float64 reference: the release's head dim and heads, a
smaller shape, -1 indices, empty rows, window-only rows and splits, d_split 2, both prefetch modes,
float_out; and the launch shape the wrapper picks for a decode step."""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the kernels under TRITON_INTERPRET=1", allow_module_level=True)

import kernels._formats  # noqa: E402
import kernels.sparse_attn  # noqa: E402

for _m in (kernels._formats, kernels.sparse_attn):  # jit functions made without the interpreter
    importlib.reload(_m)

from engine import quant as Q  # noqa: E402
from kernels import sparse_attn as A  # noqa: E402


def _inputs(g, t, h, d, n, w, k, wn, q_scale=2.0):
    q = (torch.randn(t, h, d, generator=g) * q_scale).to(torch.bfloat16)
    kvp, kvs = Q.quantize_fp4(torch.randn(n, d, generator=g), 16, "e4m3")
    w8, ws = Q.quantize_fp8(torch.randn(w, d, generator=g))
    idx = torch.randint(-1, n, (t, k), generator=g, dtype=torch.int32)
    widx = torch.randint(-1, w, (t, wn), generator=g, dtype=torch.int32)
    sink = torch.randn(h, generator=g)
    return [q, kvp, kvs, idx, w8, ws, widx, sink]


def _rel(a, b):
    assert not torch.isnan(b).any(), "NaN in the kernel's output (unwritten or invalid)"
    a, b = a.double(), b.double()
    return ((a - b).norm() / a.norm()).item()


def _check(args, **cfg):
    want = A.sparse_attn_reference(*args)
    got = A.sparse_attn_triton(*args, layout="heads_chunked", **cfg)
    assert got.dtype == torch.bfloat16 and _rel(want, got) < 1e-2
    fo = A.sparse_attn_triton(*args, layout="heads_chunked", float_out=True, **cfg)
    assert fo.dtype == torch.float32 and torch.equal(fo.bfloat16().float(), fo)
    assert ((fo - got.float()).abs() <= 2.0 ** -7 * fo.abs() + 1e-30).all() and _rel(want, fo) < 1e-2
    return want, got


@pytest.mark.parametrize("block_n,split,d_split,prefetch", [(16, 1, 1, True), (32, 2, 1, False), (16, 3, 2, True),
                                                           (32, 1, 2, False)])
def test_release_widths(poisoned, block_n, split, d_split, prefetch):
    """H = 64 heads (one program's M), D = 512 (chunks of 128): selected tiles with -1 holes, a ragged
    last tile, the window after them; row 1 selects nothing but has window slots (window-only), row 2
    has nothing at all (zeros)."""
    g = torch.Generator().manual_seed(11 + block_n + split)
    args = _inputs(g, t=3, h=64, d=512, n=70, w=40, k=40, wn=24)
    args[3][1] = -1
    args[3][2], args[6][2] = -1, -1
    _, got = _check(args, block_n=block_n, split=split, d_split=d_split, prefetch=prefetch, num_warps=8)
    assert (got[2] == 0).all() and got[1].abs().max() > 0


@pytest.mark.parametrize("block_h,split,d_split,prefetch", [(16, 1, 1, True), (8, 2, 1, True), (16, 4, 2, False)])
def test_small_heads_and_dim(poisoned, block_h, split, d_split, prefetch):
    """D = 128 (chunks of 32: the window's E8M0 byte covers one chunk's two 16-groups), 16 heads in one or
    two head blocks; split 4 leaves the last splits with window tiles only."""
    g = torch.Generator().manual_seed(5 + split)
    args = _inputs(g, t=2, h=16, d=128, n=40, w=50, k=20, wn=60)
    _check(args, block_h=block_h, block_n=16, split=split, d_split=d_split, prefetch=prefetch, num_warps=4)


def test_dominant_sink_over_window_only_splits(poisoned):
    """One selected tile over 3 splits (splits 1-2: window only); head 0's sink is huge, so its output
    vanishes: the merge adds the sink once."""
    g = torch.Generator().manual_seed(3)
    args = _inputs(g, t=2, h=16, d=64, n=20, w=60, k=16, wn=48, q_scale=0.5)
    args[7][0] = 30.0
    _, got = _check(args, block_n=16, split=3, num_warps=4)
    assert got[:, 0].abs().max() < 1e-6 < got[:, 1].abs().max()


class _Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


def test_decode_step_launch_shape():
    """64 tokens x 64 heads: one 64-head block a program, 16-entry tiles, 8 warps, prefetch on, splits to
    fill the H200's 132 SMs once (2, merged by _merge_kernel; d_split 2: its two programs a split already
    fill them, so 1 split and no merge)."""
    g = torch.Generator().manual_seed(6)
    args = [x.to("meta") for x in _inputs(g, t=64, h=64, d=512, n=8, w=8, k=500, wn=128)]
    for d_split, grid_want in ((1, (64, 2, 1)), (2, (64, 1, 2))):
        kern, merge = _Recorder(), _Recorder()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(A, "_sparse_attn_c_kernel", kern)
            mp.setattr(A, "_merge_kernel", merge)
            A.sparse_attn_triton(*args, layout="heads_chunked", d_split=d_split)
        (grid, _, kw), = kern.launches
        assert grid == grid_want
        assert (kw["BH"], kw["BN"], kw["DSPLIT"], kw["PREFETCH"], kw["num_warps"]) == (64, 16, d_split, True, 8)
        assert kw["SPLIT"] == (grid[1] > 1) and len(merge.launches) == (grid[1] > 1)
