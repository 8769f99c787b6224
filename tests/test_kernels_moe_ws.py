"""The warp-specialized MoE form (kernels/moe_ws.py): its host-side layout and argument checks here; its values
on a GPU (Gluon has no interpreter), against the Triton form of the same numerics and the float64 reference."""

from interpreted import interpreted  # noqa: F401 (first: the interpreter before triton, as the kernel tests run)

import os
import subprocess
import sys

import pytest
import torch

from kernels import moe_ws

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transposed_scales_put_a_stage_in_one_box():
    """Byte (expert e, row n, group g) lands at row e * groups + g, column n: a K step's bytes for a block of rows
    are one [groups, rows] box."""
    e, n, g = 3, 5, 4
    s = torch.arange(e * n * g, dtype=torch.uint8).view(e, n, g)
    t = moe_ws.transposed_scales(s.view(torch.float8_e8m0fnu), e)
    assert t.shape == (e * g, n) and t.dtype == torch.uint8
    for ex in range(e):
        for row in range(n):
            for grp in range(g):
                assert t[ex * g + grp, row] == s[ex, row, grp]
    assert torch.equal(moe_ws.transposed_scales(s.view(e * n, g), e), t)  # the flat [E * N, K/32] form too


def test_gluon_forms_fit_the_release_experts_and_not_the_small_models():
    """Both GEMMs in 64-row blocks and 128-wide K pairs: the release's (5120, 2304) tile, the shipped small model's
    32-row experts and widths off 128 do not (the kernel ops then keep the Triton form)."""
    assert moe_ws.gluon_fits(5120, 2304)
    assert not moe_ws.gluon_fits(64, 32) and not moe_ws.gluon_fits(5120, 2240) and not moe_ws.gluon_fits(5056, 2304)


def test_ws_forms_are_refused_by_name_and_where_they_cannot_run():
    """An unknown form, and the form where it cannot run (no hidden state: the bf16 form's own numerics; the FP8
    form), fail before any launch with a message that names the reason."""
    from kernels import moe
    x = torch.zeros(4, 64).bfloat16()
    w = torch.zeros(2, 64, 32, dtype=torch.int8)
    s = torch.full((2, 64, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    ids, tw = torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2)
    with pytest.raises(ValueError, match="ws must be one of"):
        moe.moe_fp4_triton(x, w, s, w, s, w, s, ids, tw, ws="both ways")
    with pytest.raises(ValueError, match="rs_round_trip: .* for that form"):  # its order is the rs form's
        moe.moe_fp4_triton(x, w, s, w, s, w, s, ids, tw, hidden="reference", rs_round_trip=True)
    for form in (dict(), dict(hidden="reference", fp8_mma=True)):
        with pytest.raises(ValueError, match="engine's hidden state"):
            moe.moe_fp4_triton(x, w, s, w, s, w, s, ids, tw, ws=True, **form)


_GPU_CHECK = """
import json, sys
import torch
from kernels import moe
torch.manual_seed(0)
e, inter, dim, t, k = 16, 256, 512, 512, 6
def fp4(n, kd):
    w = torch.randint(-128, 128, (e, n, kd // 2), dtype=torch.int8).cuda()
    s = torch.randint(114, 122, (e, n, kd // 32), dtype=torch.uint8).cuda().view(torch.float8_e8m0fnu)
    return w, s
W = (*fp4(inter, dim), *fp4(inter, dim), *fp4(dim, inter))
ws = json.loads(sys.argv[1])
if ws.pop("spread", False):  # every token block size's edges: 64 | 65, 80 | 81, 96 | 97, 128 | 129 pairs and more
    # past 128: 200 = 128 + 72, 300 = 2 x 128 + 44, 350 = 2 x 128 + 94, 450 = 3 x 128 + 66, 500 = 3 x 128 + 116
    counts = [0, 64, 65, 80, 81, 96, 97, 128, 129, 200, 300, 350, 400, 450, 500]
    counts.append(t * k - sum(counts))  # 132 (each at most t: an expert once a token)
    labels = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))  # sorted: an expert's pairs t apart
    ids = labels.view(k, t).t().contiguous().int().cuda()
    assert all(len(set(row.tolist())) == k for row in ids)
else:  # skewed routing: some experts past 128 pairs (split tiles), some under 64 (small tiles), one unused
    p = torch.tensor([0.0] + [1.0] * 5 + [6.0] * 10).cuda()
    ids = torch.stack([torch.multinomial(p, k) for _ in range(t)]).int()
tw = torch.softmax(torch.randn(t, k).cuda(), -1) * 1.5
x = (torch.randn(t, dim) * 0.5).bfloat16().cuda()
form = dict(hidden="reference", bf16_decode="fold", block_m=64, block_n=64, maxnreg=168, down_block_n=64,
            down_maxnreg=0, split_m=128, split_n=64, split_maxnreg=0)
counts = torch.bincount(ids.flatten().long(), minlength=e)
assert counts[0] == 0 and (counts[1:6] <= 128).any() and (counts > 128).any(), counts
ws = {key: tuple(v) if isinstance(v, list) else v for key, v in ws.items()}  # split_m: sizes as a tuple
base = moe.moe_fp4_triton(x, *W, ids, tw, **form)
ref = moe.moe_fp4_reference(x.cpu(), *(w.cpu() for w in W), ids.cpu(), tw.cpu(), hidden="reference").cuda()
rel = lambda a, b: float((a - b).norm() / b.norm())
got = moe.moe_fp4_triton(x, *W, ids, tw, **{**form, **ws})
# the same products and hidden state; sums in the MMA's K order: the Triton form's distance to the reference
print(ws, "ws vs triton", rel(got, base), "ws vs ref", rel(got, ref), "triton vs ref", rel(base, ref))
assert torch.isfinite(got).all()
assert rel(got, ref) <= 1.5 * rel(base, ref) + 1e-6, (ws, rel(got, ref), rel(base, ref))
assert rel(got, base) < 2e-3, ws
if ws.get("rs_round_trip"):  # the order made by the round trip, not by a copy: the same products and sums (the
    # float32 adds of a token's experts in any order)
    assert rel(got, moe.moe_fp4_triton(x, *W, ids, tw, **{**form, **ws, "rs_round_trip": False})) < 1e-6
"""


@pytest.mark.skipif(not moe_ws.runs_on("cuda"), reason="Gluon's wgmma form needs a Hopper GPU")
@pytest.mark.parametrize("form", [dict(ws="rs"), dict(ws="rs", ws_stages=3, split_m=None),
                                  dict(ws="rs", ws_block_k=128, ws_stages=2), dict(ws="rs", split_m=[80, 96, 128]),
                                  dict(ws="rs", split_m=[80, 96, 128], spread=True), dict(ws="rs", spread=True),
                                  dict(ws="rs", split_m=[80, 96, 128], rs_round_trip=True),
                                  dict(ws=True), dict(ws="gate_up"), dict(ws=True, ws_decoders=2, ws_persistent=1),
                                  dict(ws="down", ws_block_k=128, ws_stages=3)],
                         ids=["rs", "rs_3_stages_64_token_tiles", "rs_128_wide_stages", "rs_80_96_128",
                              "rs_80_96_128_spread", "rs_spread", "rs_round_trip", "both", "gate_up",
                              "two_decoders_persistent", "down_k128"])
def test_ws_form_on_the_gpu(form):
    """The whole MoE in a Gluon form against the Triton form and the float64 reference: the register-operand form
    (kernels/moe_rs.py; with the split tiles, with 64-token tiles alone at three stages, with 128-wide stages, in token
    blocks of 64 / 80 / 96 / 128 pairs, also over counts at every block size's edges, with its input ordered by the
    round trip), then the
    warp-specialized one: both GEMMs, the gate/up alone, two decoders looping over tiles, the down alone at 128-wide
    K (a fresh process: another module's import may have set the interpreter)."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the timeout: a stuck pipeline (a barrier never arrived) fails, not hangs
    run = subprocess.run([sys.executable, "-c", _GPU_CHECK, json.dumps(form)], env=env, capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    print(run.stdout)
