"""The tensor-core GEMV of the experts' decode (kernels/moe_mma_gemv.py): its launch shapes and refusals here; its
values on a Hopper GPU (Gluon has no interpreter), against the CUDA-core GEMV of the same numerics and the float64
reference. tests/test_kernels_compile_sm90.py builds it for sm_90 (its fragments' layouts asserted to move nothing)."""

from interpreted import interpreted  # noqa: F401 (first: the interpreter before triton, as the kernel tests run)

import os
import subprocess
import sys

import pytest
import torch

from kernels import moe_mma_gemv, moe_ws

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_steps_divide_the_k_range():
    """64-wide steps a program: the largest divisor of the step count up to the asked number, and the K splits that
    cover the range once (no masked tail)."""
    assert moe_mma_gemv._steps(5120, 8) == (8, 10)   # the release's gate/up: 80 steps
    assert moe_mma_gemv._steps(2304, 6) == (6, 6)    # its down: 36 steps
    assert moe_mma_gemv._steps(2304, 8) == (6, 6)    # 8 does not divide 36: 6 does
    assert moe_mma_gemv._steps(2304, 100) == (36, 1)  # one program the whole range
    assert moe_mma_gemv._steps(128, 0) == (1, 2)     # at least a step
    for kdim in (64, 192, 2304, 5120):
        for steps in range(1, 12):
            s, splits = moe_mma_gemv._steps(kdim, steps)
            assert s * splits * 64 == kdim and s <= steps


def test_fits_the_release_experts_and_not_the_small_models():
    assert moe_mma_gemv.fits(5120, 2304)
    assert not moe_mma_gemv.fits(64, 32) and not moe_mma_gemv.fits(5120, 2272) and not moe_mma_gemv.fits(5088, 2304)


def test_refused_where_it_cannot_run():
    """Under the interpreter (no Gluon, no mma.sync) and at widths off its tiles, the GEMV path's form fails before
    any launch, naming why; the grouped widths never take it."""
    from kernels import moe
    x = torch.zeros(1, 64).bfloat16()
    w, w2 = torch.zeros(2, 32, 32, dtype=torch.int8), torch.zeros(2, 64, 16, dtype=torch.int8)
    s, s2 = (torch.full((2, n, g), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
             for n, g in ((32, 2), (64, 1)))
    ids, tw = torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2)
    with pytest.raises(ValueError, match="gemv_mma: .* not the interpreter"):
        moe.moe_fp4_triton(x, w, s, w, s, w2, s2, ids, tw, gemv_mma=True)
    got = moe.moe_fp4_triton(x, w, s, w, s, w2, s2, ids, tw, gemv_mma=True, gemv_max_pairs=0)  # grouped: ignored
    assert torch.equal(got, moe.moe_fp4_triton(x, w, s, w, s, w2, s2, ids, tw, gemv_max_pairs=0))
    with pytest.raises(ValueError, match="gemv_mma: .* not the interpreter"):  # the decode step's widths
        moe.moe_fp4_triton(x, w, s, w, s, w2, s2, ids, tw, gemv_mma="step", gemv_max_pairs=1)
    x8, ids8, tw8 = torch.zeros(8, 64).bfloat16(), torch.tensor([[0, 1]] * 8, dtype=torch.int32), torch.ones(8, 2)
    # 16 pairs of 2 experts: a prefill's 64-token blocks, not the decode step's, so "step" leaves them grouped
    wide = moe.moe_fp4_triton(x8, w, s, w, s, w2, s2, ids8, tw8, gemv_mma="step", gemv_max_pairs=1)
    assert torch.equal(wide, moe.moe_fp4_triton(x8, w, s, w, s, w2, s2, ids8, tw8, gemv_max_pairs=1))
    with pytest.raises(ValueError, match="gemv_mma must be"):
        moe.moe_fp4_triton(x, w, s, w, s, w2, s2, ids, tw, gemv_mma="steps")


_GPU_CHECK = """
import json, sys
import torch
from kernels import moe
torch.manual_seed(0)
case = json.loads(sys.argv[1])
e, inter, dim, k = case.get("experts", 12), case["inter"], case["dim"], 6
def fp4(n, kd):
    w = torch.randint(-128, 128, (e, n, kd // 2), dtype=torch.int8).cuda()
    s = torch.randint(116, 124, (e, n, kd // 32), dtype=torch.uint8).cuda().view(torch.float8_e8m0fnu)
    return w, s
W = (*fp4(inter, dim), *fp4(inter, dim), *fp4(dim, inter))
t = case["tokens"]
ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int().cuda()
if case.get("crowded"):  # expert 0 in every token: more pairs than a block of 8 holds
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(e - 1)[:k - 1] + 1])
                       for _ in range(t)]).int().cuda()
if case.get("elsewhere"):  # another rank's slots: weight 0, never read as an expert's output
    ids[0, 1] = -1
tw = torch.softmax(torch.randn(t, k).cuda(), -1) * 1.5
x = (torch.randn(t, dim) * 0.5).bfloat16().cuda()
hidden = case.get("hidden")
form = dict(hidden=hidden, gemv_mma=case.get("mode", True), gemv_mma_steps=tuple(case["steps"]))
if form["gemv_mma"] == "step":  # the decode step's widths: grouped in 16-token blocks, or 8 pairs a program here
    assert 16 < t * k <= 4 * e, case
base = moe.moe_fp4_triton(x, *W, ids, tw, hidden=hidden)  # the CUDA-core GEMV (or the grouped form), same numerics
ref = moe.moe_fp4_reference(x.cpu(), *(w.cpu() for w in W), ids.cpu(), tw.cpu(), hidden=hidden).cuda().float()
got = moe.moe_fp4_triton(x, *W, ids, tw, **form)
rel = lambda a, b: float((a - b).norm() / b.norm())
print(case, "mma vs gemv", rel(got, base), "mma vs ref", rel(got, ref), "gemv vs ref", rel(base, ref))
assert torch.isfinite(got).all()
if hidden is None:  # h rounded to bf16 here (the grouped forms' rounding), float32 in the CUDA-core GEMV
    assert rel(got, ref) < 4e-3, case
else:  # the same hidden state and products, sums in another order: a rounding step of the hidden state may land
    # the other way (one E4M3 step of one of a pair's 2,304 values moves its output ~2.6e-3; a wrong kernel ~1)
    assert rel(got, ref) <= 1.5 * rel(base, ref) + 5e-3, case
    assert rel(got, base) < 8e-3, case
again = moe.moe_fp4_triton(x, *W, ids, tw, **form)  # the buffers start zeroed each call
assert rel(again, got) < 1e-6, case
"""


@pytest.mark.skipif(not moe_ws.runs_on("cuda"), reason="Gluon's mma.sync GEMV needs a Hopper GPU")
@pytest.mark.parametrize("case", [dict(tokens=1, dim=512, inter=256, steps=[8, 6]),
                                  dict(tokens=1, dim=512, inter=256, steps=[8, 6], hidden="reference"),
                                  dict(tokens=2, dim=512, inter=256, steps=[3, 1], hidden="reference", elsewhere=1),
                                  dict(tokens=1, dim=512, inter=256, steps=[8, 4], hidden="fp32"),
                                  dict(tokens=2, dim=5120, inter=2304, steps=[8, 6], hidden="reference"),
                                  dict(tokens=1, dim=5120, inter=2304, steps=[8, 6]),
                                  dict(tokens=5, dim=512, inter=256, steps=[2, 2], hidden="reference", mode="step",
                                       elsewhere=1),
                                  dict(tokens=20, dim=512, inter=256, steps=[8, 4], mode="step", experts=32,
                                       crowded=1),
                                  dict(tokens=20, dim=512, inter=256, steps=[4, 1], hidden="reference", mode="step",
                                       experts=32, crowded=1)],
                         ids=["plain", "hidden", "two_tokens_split_elsewhere", "fp32_hidden", "release_two_tokens",
                              "release_plain", "step_split_elsewhere", "step_crowded", "step_crowded_hidden_split"])
def test_mma_gemv_on_the_gpu(case):
    """The decode's experts on mma.sync against the CUDA-core GEMV (the grouped form at the decode step's widths) and
    the float64 reference: both numerics (the plain form's h rounded to bf16 as the grouped forms round it), with K
    splits and without (one program a row block's whole K range: no counter), a slot of another rank's, a program a
    pair and up to 8 pairs of one expert a program ("step": an expert of 20 pairs in three blocks), the release's widths (a fresh process: another module's
    import may have set the interpreter)."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _GPU_CHECK, json.dumps(case)], env=env, capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    print(run.stdout)
