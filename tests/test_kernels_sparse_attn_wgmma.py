"""The one-pass wgmma sparse attention (kernels/sparse_attn_wgmma.py): its refusals here; its values on a Hopper GPU
(Gluon has no interpreter) against the float64 reference and the two passes, in a fresh process."""

from interpreted import interpreted  # noqa: F401 (first: the interpreter before triton, as the kernel tests run)

import os
import subprocess
import sys

import pytest
import torch

from kernels import sparse_attn as A
from kernels import sparse_attn_wgmma as W
from sparse_attn_inputs import attention_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wgmma_form_refuses_what_it_cannot_tile_before_any_launch():
    """Head counts off 64-head blocks, head dims whose tiles would not fit shared memory, and other tile sizes fail
    with a message naming the limit (on any machine: no kernel is launched)."""
    g = torch.Generator().manual_seed(3)
    for h, d, match in ((16, 128, "heads a multiple of 64 \\(got 16\\)"), (64, 1024, "head dim .* \\(got 1024\\)")):
        args = attention_inputs(g, t=2, h=h, d=d, n=8, w=8, k=4, wn=4)
        with pytest.raises(ValueError, match=match):
            A.sparse_attn_triton(*args, layout="wgmma")
    args = attention_inputs(g, t=2, h=64, d=128, n=8, w=8, k=4, wn=4)
    with pytest.raises(ValueError, match="block_n 32 or 64 \\(got 48\\)"):
        A.sparse_attn_triton(*args, layout="wgmma", block_n=48)
    big = attention_inputs(g, t=2, h=64, d=512, n=8, w=8, k=4, wn=4)  # three 64-entry tiles of 512: 272 KB
    with pytest.raises(ValueError, match="278528 bytes of shared memory at head dim 512, 64-entry tiles ahead"):
        A.sparse_attn_triton(*big, layout="wgmma", wgmma=dict(ahead=True))
    assert W.shared_bytes(512, 32, True) == 2 * (64 * 512 + 3 * 32 * 512 + 2 * 64 * 32)
    # staged: one weights buffer, and a tile's packed bytes and E4M3 scales (288 bytes an entry at D = 512)
    assert W.shared_bytes(512, 64, False, staged=True) == 2 * (64 * 512 + 2 * 64 * 512 + 64 * 64) + 64 * 288
    with pytest.raises(ValueError, match="staged copies run in the two-buffer loop, not with ahead"):
        A.sparse_attn_triton(*big, layout="wgmma", block_n=32, wgmma=dict(ahead=True, staged=True))
    with pytest.raises(ValueError, match="'two_pass' or 'wgmma', got 'flash'"):
        A.sparse_attn_triton(*args, layout="flash")
    assert W.wgmma_fits(64, 512) and W.wgmma_fits(128, 128) and not W.wgmma_fits(32, 512)


def test_wgmma_form_takes_caches_past_int32_offsets(monkeypatch):
    """The form addresses entries with int64 offsets, so caches the two passes' int32 offsets cannot reach go to it
    (where the other one-pass and two-pass layouts are refused by name); checked on 'meta' tensors, the launch
    recorded instead of run."""
    seen = []
    monkeypatch.setattr(W, "sparse_attn_wgmma", lambda *a, **k: seen.append((a[1].shape[0], k)) or a[0])
    q = torch.empty(4, 64, 512, dtype=torch.bfloat16, device="meta")
    n = 2 ** 31 // 128  # 512-dim entries: past int32 word offsets
    kv, kvs = torch.empty(n, 256, dtype=torch.int8, device="meta"), torch.empty(n, 32, dtype=torch.uint8, device="meta")
    win, ws = (torch.empty(8, 512, dtype=torch.uint8, device="meta"),
               torch.empty(8, 16, dtype=torch.uint8, device="meta"))
    idx, widx = (torch.empty(4, 16, dtype=torch.int32, device="meta"),
                 torch.empty(4, 8, dtype=torch.int32, device="meta"))
    args = (q, kv, kvs, idx, win, ws, widx, torch.empty(64, device="meta"))
    assert not A.int32_offsets_reach(kv, win, 512)
    with pytest.raises(ValueError, match="int32 offsets"):
        A.sparse_attn_triton(*args, layout="two_pass")
    A.sparse_attn_triton(*args, layout="wgmma", wgmma=dict(ahead=False))
    assert seen == [(n, {"block_n": 64, "float_out": False, "n_sel": 16, "ahead": False})]


_GPU_CHECK = """
import sys
import torch
from kernels import sparse_attn as A
from tests.sparse_attn_inputs import attention_inputs
rel = lambda a, b: ((a.double() - b.double()).norm() / max(a.double().norm(), 1e-30)).item()
g = torch.Generator().manual_seed(11)
for t, h, d, n, w, k, wn, bn, opts in ((300, 64, 512, 4096, 256, 500, 128, 64, {}),
                                       (64, 64, 512, 4096, 256, 500, 128, 32, {}),
                                       (300, 64, 512, 4096, 256, 500, 128, 32, dict(ahead=True)),
                                       (300, 64, 512, 4096, 256, 500, 128, 64, dict(late_sum=True)),
                                       (300, 64, 512, 4096, 256, 500, 128, 64, dict(staged=True)),
                                       (64, 64, 512, 4096, 256, 500, 128, 32, dict(staged=True, late_sum=True)),
                                       (40, 128, 128, 512, 64, 100, 37, 64, dict(ahead=True, late_sum=True)),
                                       (40, 128, 256, 512, 64, 70, 37, 64, dict(staged=True)),
                                       (40, 64, 256, 512, 64, 0, 128, 64, {}),
                                       (40, 64, 512, 512, 64, 0, 128, 64, dict(staged=True)),
                                       (300, 64, 512, 4096, 256, 500, 128, 64, dict(staged=True, wide_store=True)),
                                       (40, 128, 256, 512, 64, 70, 37, 32, dict(wide_store=True)),
                                       (300, 64, 512, 4096, 256, 500, 128, 64,
                                        dict(staged=True, wide_store=True, late_sum=True))):
    args = [x.cuda() for x in attention_inputs(g, t=t, h=h, d=d, n=n, w=w, k=k, wn=wn)]
    args[3][1] = -1  # a token with nothing selected and nothing in its window: zeros
    args[6][1] = -1
    want = A.sparse_attn_reference(*args)
    form = dict(layout="wgmma", block_n=bn, wgmma=opts)
    got = A.sparse_attn_triton(*args, **form)
    two = A.sparse_attn_triton(*args, layout="two_pass", two_pass=dict(decode="bf16x2"))
    f32 = A.sparse_attn_triton(*args, **form, float_out=True)
    print((t, h, d, k, wn, bn, opts), "vs float64", rel(want, got), "vs two passes", rel(two, got),
          "two passes vs float64", rel(want, two))
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(f32, got.float())  # float_out: the bf16 output's values
    # P rounded to bf16 where the two passes keep float16 weights: within a few of their distances
    assert rel(want, got) < 1e-2 and rel(want, got) < 4 * rel(want, two) + 1e-3, (rel(want, got), rel(want, two))
"""


@pytest.mark.skipif(not W.runs_on("cuda"), reason="Gluon's wgmma form needs a Hopper GPU")
def test_wgmma_form_on_the_gpu():
    """Release shapes (500 selected FP4 entries + 128 FP8 window slots, 64 heads of 512, both tile sizes, S a tile
    ahead, the sums late, the copies staged, the output stored 16 bytes at a time), other head
    dims and counts, window-only layers and an empty token,
    against the float64 reference and the two passes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _GPU_CHECK], env=env, capture_output=True, text=True, cwd=REPO)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-3000:]
